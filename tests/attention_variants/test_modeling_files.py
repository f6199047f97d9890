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
