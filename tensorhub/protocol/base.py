"""The protocol's limits, the names it accepts, the dtypes it knows, and the base of its
request models (``tensorhub.protocol``). The limits bound every request; they are
documented in the README ("Limits")."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "v1"

#: Largest request body the coordinator accepts (bytes).
MAX_BODY_BYTES = 64 << 20
#: Most tensors in one manifest.
MAX_TENSORS = 200_000
#: Longest tensor / model / layout name.
MAX_NAME_LEN = 512
#: Most dimensions of one tensor.
MAX_DIMS = 16
#: Largest single tensor (bytes) and largest shard (bytes): 1 PiB, far above any model.
MAX_TENSOR_BYTES = 1 << 50
#: Most shards per layout.
MAX_SHARDS = 65_536
#: Largest version number.
MAX_VERSION = (1 << 53) - 1
#: Most chunks of one shard's pipelining grid.
MAX_CHUNKS = 1 << 22

#: dtype name -> bytes per element. Names follow torch (``torch.float32`` -> ``float32``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_NAME_RE = re.compile(r"^[^\x00-\x1f\x7f]+$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[^\x00-\x1f\x7f]+$")]
Ident = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]
#: Model names travel in URL paths: no slash, no spaces.
ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+=-]+$")]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION)]
Shard = Annotated[int, Field(ge=0, lt=MAX_SHARDS)]
Address = Annotated[int, Field(ge=0, lt=1 << 64)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
