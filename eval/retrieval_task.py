"""Retrieval tasks: a fact stated once, early or late in a long text, asked for at its end.

Perplexity is nearly blind to what KV compression destroys: a key that falls out of a sliding window,
or that a coarsely quantized cache blurs, costs little on average next-token loss and everything
when the question is about it. Three kinds, each offline and seeded (the same prompts every run):

- ``passkey``: a 5-digit key in repeated filler sentences (Landmark Attention's test).
- ``needle``: one sentence holding a number inside real held-out prose (``wikipedia:eval``);
  ``needle_pydoc`` the same inside Python's documentation (``pydoc:eval``: code, signatures, tables).
- ``multikey``: three keys with different labels in the filler, one of them asked.

Each is laid out at every context length (prompt tokens) and depth (where the fact sits, 0% = the
start of the text, 100% = just before the question), ``samples`` prompts each (seeded by their
index from ``first_sample``, so later indices are new prompts: a planner ranks on some and checks
on others). A prompt is
answered by greedy generation through the backend (the kvslim engine serves it with its KV cache
really compressed); it is right when the first number in the answer is the key. Accuracy is
reported overall and per context and depth.

The ``*_calib`` variants use other filler, other wording and ``wikipedia:calib`` prose (``pysrc:calib``,
the standard library's source, for ``needle_code_calib``; ``pyhelp:calib``, other modules' ``help()``
text, for ``needle_doc_calib``): what a planner may tune on, disjoint from the evaluation tasks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from dataclasses import dataclass

from foundation.errors import KvslimError

DEFAULT_CONTEXTS = (1024, 2048)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_SAMPLES = 4
ANSWER_TOKENS = 10


@dataclass(frozen=True)
class Wording:
    """The sentences of one kind of retrieval prompt (eval and calibration differ in all of them)."""

    intro: str
    filler: str
    fact: str  # with {key}, and {label} for multikey
    question: str  # with {label} for multikey; ends where the answer starts
    labels: tuple[str, ...] = ()
    prose: str | None = None  # a named text range for needle prompts, else filler

    @property
    def digest(self) -> str:
        """A short hash of every field: part of the results cache key, so a reworded task re-runs."""
        return hashlib.sha256(json.dumps(dataclasses.astuple(self)).encode()).hexdigest()[:12]


EVAL_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
CALIB_FILLER = "The river runs to the sea. The hills are quiet tonight. A bird sings on the wall. Time moves on. "

WORDINGS: dict[str, Wording] = {
    "passkey": Wording(
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it.\n", EVAL_FILLER,
        "The pass key is {key}. Remember it. {key} is the pass key. ",
        "\nWhat is the pass key? The pass key is"),
    "needle": Wording(
        "", "", "The magic number of the day is {key}. ",
        "\nQuestion: what is the magic number of the day? Answer: the magic number of the day is",
        prose="wikipedia:eval"),
    "needle_pydoc": Wording(
        "", "", "The magic number of the day is {key}. ",
        "\nQuestion: what is the magic number of the day? Answer: the magic number of the day is",
        prose="pydoc:eval"),
    "multikey": Wording(
        "Several keys are hidden inside a lot of irrelevant text. Remember each of them.\n", EVAL_FILLER,
        "The pass key for the {label} door is {key}. ",
        "\nWhat is the pass key for the {label} door? The pass key for the {label} door is",
        labels=("red", "blue", "green")),
    "passkey_calib": Wording(
        "Somewhere in the notes below is a code. Keep it in mind; you will be asked for it.\n", CALIB_FILLER,
        "The secret code is {key}. Keep it safe: {key}. ",
        "\nWhich secret code was given? The secret code is"),
    "needle_calib": Wording(  # a "number", not a "code": asked for a code, the model named one at depth 0
        "", "", "The lucky number for today is {key}. ",
        "\nQuestion: which lucky number was mentioned for today? Answer: the lucky number for today is",
        prose="wikipedia:calib"),
    "needle_code_calib": Wording(  # a "number", as needle_calib: inside source a "code" is code
        "", "", "The secret number for this week is {key}. ",
        "\nQuestion: what is the secret number for this week? Answer: the secret number for this week is",
        prose="pysrc:calib"),
    "needle_doc_calib": Wording(  # documentation, as needle_pydoc's text is; neither wording of the code needle
        "", "", "The reference number of this page is {key}. ",
        "\nQuestion: what is the reference number of this page? Answer: the reference number of this page is",
        prose="pyhelp:calib"),
    "multikey_calib": Wording(
        "The notes below hold several codes. Remember each one.\n", CALIB_FILLER,
        "The code of the {label} gate is {key}. ",
        "\nWhat is the code of the {label} gate? The code of the {label} gate is",
        labels=("north", "south", "east")),
}
RETRIEVAL_TASKS = tuple(WORDINGS)


@dataclass(frozen=True)
class RetrievalPrompt:
    text: str
    answer: str  # the key's digits
    context: int  # the prompt length asked for, in tokens
    depth: int  # percent
    fact_span: tuple[int, int] = (0, 0)  # characters of the asked fact in ``text``


@dataclass(frozen=True)
class RetrievalTask:
    name: str  # a key of WORDINGS
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    samples: int = DEFAULT_SAMPLES
    first_sample: int = 0  # the seeded index of the first prompt at each context and depth

    @property
    def wording(self) -> Wording:
        return WORDINGS[self.name]

    @property
    def longest(self) -> int:
        """Tokens the engine must hold: the longest prompt and its answer."""
        return max(self.contexts) + ANSWER_TOKENS + 16

    def prompts(self, tokenizer) -> list[RetrievalPrompt]:
        """Every prompt, in (context, depth, sample) order; the same for the same tokenizer."""
        prose = _prose_ids(tokenizer, self.wording.prose, max(self.contexts) * 3) if self.wording.prose else None
        if prose is not None and len(prose) < max(self.contexts):
            raise KvslimError(f"{self.name} at {max(self.contexts)} tokens needs that much text of "
                              f"{self.wording.prose}, which has {len(prose)} tokens")
        return [self._prompt(tokenizer, ctx, depth, i, prose)
                for ctx in self.contexts for depth in self.depths
                for i in range(self.first_sample, self.first_sample + self.samples)]

    def _prompt(self, tokenizer, ctx: int, depth: int, i: int, prose: list[int] | None) -> RetrievalPrompt:
        w = self.wording
        rng = random.Random(f"{self.name}:{ctx}:{depth}:{i}")
        key = str(rng.randrange(10_000, 100_000))
        label = rng.choice(w.labels) if w.labels else ""
        facts = {depth: w.fact.format(key=key, label=label)}
        for other in w.labels:  # multikey: the other labels' keys elsewhere in the text
            if other != label:
                facts.setdefault(rng.choice([d for d in range(0, 101, 5) if d not in facts]),
                                 w.fact.format(key=str(rng.randrange(10_000, 100_000)), label=other))
        question = w.question.format(label=label)
        fixed = len(tokenizer(w.intro + question + "".join(facts.values()), add_special_tokens=False)["input_ids"])
        room = max(16, ctx - fixed)
        if prose is not None:
            start = rng.randrange(0, max(1, len(prose) - room))
            haystack = tokenizer.decode(prose[start:start + room])
            sentences = re.split(r"(?<=[.!?])\s+", haystack)
        else:
            unit = len(tokenizer(w.filler, add_special_tokens=False)["input_ids"])
            sentences = re.split(r"(?<=[.!?])\s+", (w.filler * max(1, room // unit)).strip())
        text = w.intro + _place(sentences, facts) + question
        fact = facts[depth].strip()
        at = text.index(fact)
        return RetrievalPrompt(text, key, ctx, depth, (at, at + len(fact)))


def _place(sentences: list[str], facts: dict[int, str]) -> str:
    """Sentences with each fact inserted at its depth (percent of the sentences before it)."""
    out = list(sentences)
    for depth, fact in sorted(facts.items(), reverse=True):  # deepest first: earlier indices stay put
        at = round(depth / 100 * len(sentences))
        out.insert(at, fact.strip())
    return " ".join(s.strip() for s in out if s.strip())


def _prose_ids(tokenizer, text_range: str, tokens: int) -> list[int]:
    from foundation.perplexity import tokenize_range

    return tokenize_range(tokenizer, text_range, max_tokens=tokens).tolist()


def answered(generated: str, answer: str) -> bool:
    """The first number in the generated text is the key."""
    found = re.search(r"\d+", generated)
    return found is not None and found.group(0) == answer


def score(task: RetrievalTask, prompts: list[RetrievalPrompt], generated: list[str]) -> tuple[float, dict[str, float]]:
    """(accuracy, per ``acc@ctx{C}/depth{D}`` and per ``acc@ctx{C}``)."""
    hits = [answered(g, p.answer) for p, g in zip(prompts, generated)]
    metrics: dict[str, float] = {}
    for ctx in task.contexts:
        at_ctx = [h for p, h in zip(prompts, hits) if p.context == ctx]
        metrics[metric_name(ctx)] = sum(at_ctx) / len(at_ctx)
        for depth in task.depths:
            cell = [h for p, h in zip(prompts, hits) if p.context == ctx and p.depth == depth]
            metrics[metric_name(ctx, depth)] = sum(cell) / len(cell)
    return sum(hits) / len(hits), metrics


CONTEXT_METRIC = "acc@ctx"  # + context [+ "/depth" + depth]: ``score``'s metric keys


def metric_name(context: int, depth: int | None = None) -> str:
    """``score``'s metric key: the accuracy at ``context`` tokens (at ``depth`` percent, if given)."""
    return f"{CONTEXT_METRIC}{context}" if depth is None else f"{CONTEXT_METRIC}{context}/depth{depth}"


def depth_accuracies(metrics: dict[str, float], context: int) -> dict[int, float]:
    """From ``score``'s metrics: the accuracy at each depth (percent) of ``context``, in depth order
    (empty where that context was not run)."""
    prefix = metric_name(context) + "/depth"
    return dict(sorted((int(k[len(prefix):]), v) for k, v in metrics.items() if k.startswith(prefix)))


def contexts_run(metrics: dict[str, float]) -> list[int]:
    """The contexts ``score``'s metrics hold, ascending."""
    n = len(CONTEXT_METRIC)
    return sorted(int(k[n:]) for k in metrics if k.startswith(CONTEXT_METRIC) and "/" not in k)


def by_depth_line(by_depth: dict[int, float]) -> str:
    """"0%:100 50%:75 ...": accuracy in points at each depth."""
    return " ".join(f"{d}%:{100 * a:.0f}" for d, a in by_depth.items())
