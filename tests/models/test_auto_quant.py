"""`--quant auto`: a GGUF of 4-bit K-quants runs as w4a8 where the kernel runs, anything else as stored; the
choice and its reason are one line. The header reader that decides it agrees with gguf-py's full reader."""

from __future__ import annotations

import gguf
import pytest
from conftest import save_tiny_model
from gguf_files import Q4_K, Q8_0, write_gguf
from test_quantized_load import SHAPE, TYPES

from specdecode.cli.main import main
from specdecode.errors import SpecDecodeError
from specdecode.models.auto_quant import choose_quant
from specdecode.models.formats.gguf_header import tensor_types
from specdecode.models.kernels import w4a8_linear


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    source = save_tiny_model(root / "hf", "qwen2", seed=3, tie_word_embeddings=False, **SHAPE)
    k_quants, q8 = root / "q4_k_m.gguf", root / "q8_0.gguf"
    write_gguf(k_quants, source, "qwen2", qtypes=TYPES)  # mostly Q4_K, as a Q4_K_M file
    write_gguf(q8, source, "qwen2", qtypes={name: Q8_0 for name in TYPES})
    return source, k_quants, q8


def test_header_reader_agrees_with_gguf_py(files):
    for path in files[1:]:
        expected = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}
        assert tensor_types(path) == expected
    assert tensor_types(files[1])["blk.0.attn_q.weight"] == Q4_K


def test_a_truncated_file_is_a_clear_error(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files[1].read_bytes()[:2000])
    with pytest.raises(SpecDecodeError, match="not a readable GGUF"):
        tensor_types(cut)


def test_k_quants_run_as_w4a8_where_the_kernel_runs(files, monkeypatch):
    monkeypatch.setattr(w4a8_linear, "w4a8_unavailable", lambda quiet=True: None)
    assert choose_quant(files[1], "cpu", 32)[0] == "w4a8"
    assert choose_quant(files[1], "cpu", 64) == ("none", "4-bit K-quants, but w4a8 needs --group-size 32: "
                                                         "converted to float")
    assert choose_quant(files[1], "cuda", 32)[0] == "none"


def test_without_the_kernel_k_quants_are_converted_to_float_and_say_why(files, monkeypatch):
    monkeypatch.setattr(w4a8_linear, "w4a8_unavailable", lambda quiet=True: "it needs a CPU with avx2")
    quant, reason = choose_quant(files[1], "cpu", 32)
    assert quant == "none" and "avx2" in reason


def test_float_checkpoints_and_other_quants_keep_their_weights(files):
    assert choose_quant(files[0], "cpu", 32)[0] == "none"  # a safetensors folder is never quantized unasked
    quant, reason = choose_quant(files[2], "cpu", 32)
    assert quant == "none" and "Q8_0" in reason


@pytest.mark.skipif(w4a8_linear.w4a8_unavailable() is not None, reason="this CPU has no w4a8 kernel")
def test_generate_says_what_auto_chose_and_why(files, capsys):
    assert main(["generate", "hello", "--model", str(files[1]), "--max-tokens", "4", "--spec-type", "ngram"]) == 0
    err = capsys.readouterr().err
    assert "--quant auto -> w4a8 (4-bit K-quants" in err
    assert main(["generate", "hello", "--model", str(files[1]), "--max-tokens", "4", "--quiet"]) == 0
    assert "--quant auto" not in capsys.readouterr().err

