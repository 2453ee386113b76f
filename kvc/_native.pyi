from collections.abc import Sequence

# The buffers are anything with the buffer protocol (NumPy arrays here); NumPy's stubs
# do not declare it before Python 3.12, so they are typed as object.
def chain_keys(
    tokens: Sequence[int],
    salt: bytes,
    person: bytes,
    block_size: int,
    parent: int,
    layout: int,
    /,
) -> list[int]: ...
def probe_set_ids(
    keys: Sequence[int],
    start: int,
    end: int,
    table_keys: object,
    table_ids: object,
    overflowed: object,
    rows: int,
    mult: int,
    row: int,
    out: object,
    /,
) -> None: ...
def probe_runs(
    keys: Sequence[int],
    start: int,
    end: int,
    table_keys: object,
    table_ids: object,
    overflowed: object,
    rows: int,
    mult: int,
    row: int,
    last: int,
    /,
) -> list[int]: ...
def probe_slots(
    keys: Sequence[int],
    table_keys: object,
    table_ids: object,
    overflowed: object,
    rows: int,
    mult: int,
    row: int,
    /,
) -> list[int]: ...
def place_keys(
    keys: Sequence[int],
    set_id: int,
    table_keys: object,
    table_ids: object,
    overflowed: object,
    rows: int,
    mult: int,
    row: int,
    /,
) -> int: ...
def survival_areas(
    survival: Sequence[float], widths: object, tail: float, /
) -> tuple[list[float], int]: ...
def survival_pmf(survival: Sequence[float], scale: float, out: object, /) -> None: ...
def kaplan_meier(
    exact: object, censored: object, unwatched: object, scale: float, pseudo: object, /
) -> list[float]: ...
