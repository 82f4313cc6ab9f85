"""An export carries the run's tokenizer as it is: the character tokenizer built here encodes
spaces and newlines, which transformers 5's `AutoTokenizer` (mapping a Qwen2 directory to its own
byte-level `Qwen2Tokenizer`) drops; re-saving through it made an exported browser policy score
0.000 where its run scored 0.225."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from decentrl.config import ConfigError, ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.release.export import PROBE, write_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128))
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("base"))


def test_the_export_encodes_whitespace_as_the_run_did(base: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    write_tokenizer(base, tmp_path)
    run = Tokenizer.from_file(str(base / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    space, newline = (
        run_id for run_id in Tokenizer.from_file(str(base / "tokenizer.json")).encode(" \n").ids
    )
    assert space in run and newline in run  # the probe exercises what a rebuilt tokenizer loses
    assert (
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
        == run
    )
    assert (
        PreTrainedTokenizerFast.from_pretrained(tmp_path)(PROBE, add_special_tokens=False)["input_ids"] == run
    )


def test_a_tokenizer_that_encodes_otherwise_stops_the_export(base: Path, tmp_path: Path, monkeypatch) -> None:
    """The check compares what was written with the run's own `tokenizer.json`."""
    from tokenizers import pre_tokenizers

    import decentrl.release.export as export

    broken = Tokenizer.from_file(str(base / "tokenizer.json"))
    broken.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops the spaces, as Qwen2Tokenizer did
    broken.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes((base / "tokenizer_config.json").read_bytes())
    monkeypatch.setattr(export, "TOKENIZER_FILES", ())  # keep the broken files in place of a copy
    with pytest.raises(ConfigError, match="encodes differently"):
        write_tokenizer(base, tmp_path)
