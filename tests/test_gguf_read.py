"""The one-pass GGUF header reader against gguf-py's GGUFReader, on a file with every value type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from gguf_fixtures import Q, random_blocks
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.gguf_check import read_header


@pytest.fixture()
def path(tmp_path):
    p = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    V = gguf.GGUFValueType
    for i, (vt, value) in enumerate(
        [
            (V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60000), (V.INT16, -30000),
            (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000), (V.FLOAT32, 0.1),
            (V.BOOL, True), (V.STRING, "héllo ✓"), (V.UINT64, 2**60), (V.INT64, -(2**60)),
            (V.FLOAT64, 1 / 3),
        ]
    ):  # fmt: skip
        w.add_key_value(f"k.{i}.{vt.name}", value, vt)
    w.add_key_value("a.int32", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("a.float32", [0.5, -1.25], V.ARRAY, V.FLOAT32)
    w.add_key_value("a.bool", [True, False], V.ARRAY, V.BOOL)
    w.add_array("a.str", ["", "a", "日本", "<0x0A>"])
    w.add_tensor("x.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("k.weight", random_blocks(Q.Q4_K, 3, 512, seed=1), raw_dtype=Q.Q4_K)
    w.add_tensor("h.weight", np.ones((4, 8, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def test_header_equals_gguf_reader(path):
    ours = read_header(path)
    ref = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        got = ours.metadata[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        want = field.contents()
        if key.endswith("FLOAT32") or key == "a.float32":
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want and type(got) is type(want), key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    table = [(t.name, t.shape, t.ggml_type, t.offset, t.nbytes) for t in ours.tensors]
    assert table == [
        (
            t.name,
            tuple(int(d) for d in reversed(t.shape)),
            t.tensor_type,
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in ref.tensors
    ]
    assert table[1][1] == (3, 512) and table[2][1] == (4, 8, 32)


def test_truncated_data_is_an_error_not_a_crash(path):
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ModelLoadError, match="outside the data section"):
        read_header(path)
    path.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        read_header(path)
