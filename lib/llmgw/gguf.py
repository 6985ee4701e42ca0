"""A GGUF file's header, and what a replica of it needs in memory.

The header is parsed here rather than with the `gguf` package: its reader builds a
Python object for every one of the 262k vocabulary strings of a Gemma 3 model and takes
about 9 s on the 253 MB demo model; this one skips arrays by their lengths and reads the
same header in a few tens of milliseconds. Scalars are kept; of arrays only the length,
except short numeric ones (per-layer head counts, which the KV estimate needs).

The estimate is an upper bound to place by until a replica has run; `corrected` lets
what replicas really used take over after that.
"""

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import Error

MAGIC = b"GGUF"
# A split GGUF is NAME-00001-of-00003.gguf and its siblings; llama.cpp is given the first.
SPLIT = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
VERSIONS = (2, 3)
MiB = 1 << 20

# Value types: struct format for each fixed-size scalar.
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR.items()}
# Numeric arrays up to this long are kept as tuples (per-layer values); longer are skipped.
_KEEP_ARRAY = 4096

# ggml type -> (elements per block, bytes per block), as in ggml's type traits.
GGML_BLOCKS = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 36),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}


class GGUFError(Error):
    """A file is not a GGUF model llmgw can read (wrong magic, version, or truncated)."""


@dataclass
class Header:
    path: str
    version: int
    tensor_count: int
    metadata: dict = field(default_factory=dict)  # key -> scalar, str, or short numeric tuple
    array_lengths: dict[str, int] = field(default_factory=dict)  # every array key -> length
    tensor_bytes: int = 0  # weights, from dims and types (file-size based if a type is unknown)
    data_offset: int = 0  # where tensor data starts
    file_size: int = 0
    unknown_types: tuple[int, ...] = ()  # ggml types not in GGML_BLOCKS

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch(self, key: str, default=None):
        """`<architecture>.<key>`, e.g. arch("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv_cache: int
    overhead: int
    total: int


class _Truncated(Exception):
    pass


def read_header(path) -> Header:
    """Parse the header of the GGUF file at `path`; GGUFError if it is not one or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{path}: not a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, str(path), size)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e
    except (_Truncated, struct.error, IndexError) as e:
        raise GGUFError(f"{path}: truncated GGUF header ({e or 'ends early'})") from e
    except UnicodeDecodeError as e:
        raise GGUFError(f"{path}: corrupt GGUF header (a key is not UTF-8)") from e


def _parse(buf, name: str, size: int) -> Header:
    if buf[:4] != MAGIC:
        raise GGUFError(f"{name}: not a GGUF file (starts with {bytes(buf[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in VERSIONS:
        raise GGUFError(f"{name}: GGUF version {version} is not supported (want 2 or 3)")
    if n_kv > size or n_tensors > size:
        raise _Truncated(f"{n_kv} keys, {n_tensors} tensors in {size} bytes")
    unpack_from = struct.unpack_from
    off = 24
    meta: dict = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key, off = _string(buf, off, size)
        (vtype,) = unpack_from("<I", buf, off)
        off += 4
        if vtype == _ARRAY:
            etype, count = unpack_from("<IQ", buf, off)
            off += 12
            lengths[key] = count
            if etype == _STRING:
                # The tokenizer's vocabulary: hop from length to length, build nothing.
                for _ in range(count):
                    off += 8 + unpack_from("<Q", buf, off)[0]
            elif etype in _SIZE:
                if count <= _KEEP_ARRAY:
                    meta[key] = unpack_from(f"<{count}{_SCALAR[etype][1]}", buf, off)
                off += count * _SIZE[etype]
            else:
                raise GGUFError(f"{name}: key {key!r} is an array of unsupported type {etype}")
        elif vtype == _STRING:
            meta[key], off = _string(buf, off, size, errors="replace")
        elif vtype in _SCALAR:
            (meta[key],) = unpack_from(_SCALAR[vtype], buf, off)
            off += _SIZE[vtype]
        else:
            raise GGUFError(f"{name}: key {key!r} has unknown value type {vtype}")
        if off > size:
            raise _Truncated(f"in metadata key {key!r}")

    tensor_bytes = 0
    end = 0  # end of the furthest tensor whose size is known, relative to data_offset
    unknown: set[int] = set()
    for _ in range(n_tensors):
        tname, off = _string(buf, off, size, errors="replace")
        (n_dims,) = unpack_from("<I", buf, off)
        if n_dims > 8:
            raise GGUFError(f"{name}: tensor {tname!r} has {n_dims} dimensions")
        dims = unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, toff = unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 16 + 8 * n_dims
        block = GGML_BLOCKS.get(ttype)
        if block is None:
            unknown.add(ttype)
            continue
        n = 1
        for d in dims:
            n *= d
        nbytes = -(-n // block[0]) * block[1]
        tensor_bytes += nbytes
        end = max(end, toff + nbytes)
    if off > size:
        raise _Truncated("in tensor infos")

    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        align = 32
    data_offset = -(-off // align) * align
    if data_offset + end > size:
        raise GGUFError(f"{name}: truncated: tensor data ends at byte {data_offset + end}, "
                        f"the file has {size}")  # fmt: skip
    if unknown:
        # A type this table does not know yet: the data region is the best figure there is.
        tensor_bytes = max(tensor_bytes, size - data_offset)
    return Header(path=name, version=version, tensor_count=n_tensors, metadata=meta,
                  array_lengths=lengths, tensor_bytes=tensor_bytes, data_offset=data_offset,
                  file_size=size, unknown_types=tuple(sorted(unknown)))  # fmt: skip


def _string(buf, off: int, size: int, errors: str = "strict") -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    start = off + 8
    if start + n > size:
        raise _Truncated(f"a string of {n} bytes at byte {off}")
    return bytes(buf[start : start + n]).decode("utf-8", errors), start + n


def _per_layer(value, n_layer: int) -> list[int]:
    if isinstance(value, tuple):
        vals = [int(v) for v in value[:n_layer]]
        return vals + [vals[-1] if vals else 0] * (n_layer - len(vals))
    return [int(value)] * n_layer


def estimate(header: Header, context: int, parallel: int) -> Estimate:
    """Bytes one replica needs with `parallel` slots of `context` tokens each.

    weights: the tensors, all loaded (mmap'd pages count once resident).
    kv_cache: an f16 K and V for every layer and every cell, cells = context × parallel
      (llama.cpp's --ctx-size is shared by the slots). Sliding-window layers (Gemma 3)
      are counted at full size, as the agent's --swa-full allocates them (engines.py).
    overhead: 64 MiB for the process, the graph allocator and the runtime, plus f32
      activations that grow with the cells (cells × embedding × 4: the attention scratch
      and per-token buffers), plus the f32 logits of one token per slot (n_vocab × 4
      × parallel). A heuristic, not llama.cpp's own arithmetic: measured replicas
      correct it (see `corrected`).
    """
    n_layer = int(header.arch("block_count", 0) or 0)
    n_embd = int(header.arch("embedding_length", 0) or 0)
    heads = _per_layer(header.arch("attention.head_count", 1) or 1, n_layer)
    heads_kv = _per_layer(header.arch("attention.head_count_kv", None) or tuple(heads), n_layer)
    head_dim = n_embd // max(heads[0], 1) if heads else 0
    k_len = int(header.arch("attention.key_length", head_dim) or head_dim)
    v_len = int(header.arch("attention.value_length", head_dim) or head_dim)
    cells = context * parallel
    kv = sum(h * (k_len + v_len) for h in heads_kv) * cells * 2
    n_vocab = header.array_lengths.get("tokenizer.ggml.tokens", 0)
    n_vocab = int(header.arch("vocab_size", n_vocab) or n_vocab)
    overhead = 64 * MiB + cells * n_embd * 4 + n_vocab * 4 * parallel
    weights = header.tensor_bytes
    return Estimate(weights=weights, kv_cache=kv, overhead=overhead,
                    total=weights + kv + overhead)  # fmt: skip


def corrected(estimate_total: int, measured: list[int]) -> int:
    """What to place by: the most any replica used plus 10%, once one has run; else the estimate."""
    if not measured:
        return estimate_total
    most = max(measured)
    return max(most, -(-most * 11 // 10))
