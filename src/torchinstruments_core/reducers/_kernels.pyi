"""Types of the compiled CPU reductions (``_kernels.c``); see ``_native.py`` for their use."""

LAYOUT: int
LINGER_MAX_NS: int  # with the queue only (not on Windows)

def reduce(
    data: int,
    numel: int,
    dtype: int,
    index: int,
    size: int,
    ranks: int,
    count: int,
    bins: int,
    out: int,
    counts: int,
    /,
) -> int: ...
def profile(
    data: int,
    numel: int,
    dtype: int,
    index: int,
    size: int,
    ranks: object,
    levels: object,
    bins: int,
    numbers: object,
    values: object,
    /,
) -> int: ...
def draw(seed: int, numel: int, size: int, out: int, /) -> None: ...
def histogram(
    data: int, numel: int, dtype: int, lo: float, hi: float, bins: int, grid: int, counts: int, /
) -> int: ...
def order_statistics(
    data: int, dtype: int, index: int, size: int, ranks: int, count: int, out: int, /
) -> None: ...
def edges(dtype: int, lo: float, hi: float, scale: float, bins: int, out: int, /) -> None: ...
def crc32c(data: bytes, /) -> int: ...
def ratio_sum(
    gradient: int, second: int, numel: int, dtype: int, correction: float, floor: float, /
) -> float: ...
def shifted_squares(values: int, numel: int, dtype: int, shift: float, /) -> float: ...
def difference_squares(after: int, before: int, out: int, numel: int, dtype: int, /) -> float: ...
def queue_new(linger_ns: int = ..., /) -> object: ...
def queue_submit(
    queue: object,
    seed: int | None,
    data: int,
    numel: int,
    dtype: int,
    index: int,
    size: int,
    ranks: object,
    levels: object,
    bins: int,
    numbers: object,
    values: object,
    /,
) -> int: ...
def queue_copy(queue: object, source: int, destination: int, nbytes: int, /) -> int: ...
def queue_finished(queue: object, /) -> int: ...
def queue_wakes(queue: object, /) -> int: ...
def queue_helped(queue: object, /) -> int: ...
def queue_wait(queue: object, ticket: int, run: int = ..., /) -> None: ...
def queue_close(queue: object, /) -> None: ...
