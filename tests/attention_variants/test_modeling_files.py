import shutil

from attention_variants.modeling_files import (
    MODELING_DIR,
    MODELING_FILE,
    checkpoint_code_is_ours,
    is_our_modeling_file,
    known_modeling_hashes,
)


def test_our_file_is_recognised_and_a_modified_copy_is_not(tmp_path):
    assert MODELING_FILE in known_modeling_hashes()
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy2(MODELING_DIR / MODELING_FILE, good / MODELING_FILE)
    assert is_our_modeling_file(good / MODELING_FILE) and checkpoint_code_is_ours(good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MODELING_FILE).write_text((MODELING_DIR / MODELING_FILE).read_text() + "\nimport os\n")
    assert not is_our_modeling_file(bad / MODELING_FILE) and not checkpoint_code_is_ours(bad)
    shutil.copy2(MODELING_DIR / MODELING_FILE, bad / MODELING_FILE)
    (bad / "other.py").write_text("x = 1\n")
    assert not checkpoint_code_is_ours(bad)
    assert not checkpoint_code_is_ours(tmp_path / "empty")


def test_an_earlier_version_is_ours_under_its_name_only(tmp_path, monkeypatch):
    import attention_variants.modeling_files as mf

    old = tmp_path / "old"
    old.mkdir()
    (old / MODELING_FILE).write_text("# an earlier release\n")
    assert not is_our_modeling_file(old / MODELING_FILE)
    monkeypatch.setattr(mf, "EARLIER_MODELING_KVSLIM", frozenset({mf._sha256(old / MODELING_FILE)}))
    assert is_our_modeling_file(old / MODELING_FILE) and checkpoint_code_is_ours(old)
    (old / MODELING_FILE).rename(old / "modeling_other.py")
    assert not checkpoint_code_is_ours(old)


def test_every_committed_version_is_listed():
    """Each version of the modeling file in this repository's history is accepted (the list is kept
    up to date when the file changes); skipped outside a git checkout."""
    import hashlib
    import subprocess

    import pytest

    from attention_variants.modeling_files import EARLIER_MODELING_KVSLIM

    rel = "attention_variants/modeling/modeling_kvslim.py"
    root = MODELING_DIR.parents[1]
    log = subprocess.run(["git", "log", "--format=%H", "--", rel], cwd=root, capture_output=True, text=True)
    if log.returncode != 0 or not log.stdout.strip():
        pytest.skip("not a git checkout with history")
    current = known_modeling_hashes()[MODELING_FILE]
    for commit in log.stdout.split():
        blob = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=root, capture_output=True).stdout
        digest = hashlib.sha256(blob).hexdigest()
        assert digest == current or digest in EARLIER_MODELING_KVSLIM, commit
