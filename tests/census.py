"""What is still alive when a pool-accounting check fails: the live CudaTensor objects by
(shape, dtype), what refers to them, and for frames that hold them, where those frames are
and what keeps the frames alive, so a leak report names its suspects."""
from __future__ import annotations

import collections
import gc
import os
import types


def _where(frame: types.FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


def _innermost(frame: types.FrameType, depth: int = 50) -> tuple:
    """Follow the frames whose f_back is this one down to the last: (where it is, the types
    of what refers to it other than frames, the search's own lists)."""
    for _ in range(depth):
        refs = gc.get_referrers(frame)
        child = None
        for r in refs:                  # a plain loop: a generator would hold `frame` itself
            if isinstance(r, types.FrameType) and r.f_back is frame:
                child = r
                break
        if child is None:
            kinds = sorted({type(r).__name__ for r in refs
                            if not isinstance(r, (types.FrameType, list))})
            return _where(frame), ",".join(kinds) or "-"
        frame = child
    return _where(frame), "deep"


def live_tensors(limit: int = 6) -> str:
    from cuda_backend.tensor import CudaTensor
    gc.collect()
    alive = [o for o in gc.get_objects()
             if isinstance(o, CudaTensor) and getattr(o, "_ptr", None) is not None]
    by_kind = collections.Counter((o.shape, o.dtype.name_str) for o in alive)
    holders = collections.Counter()
    frames = collections.Counter()
    frame_holders = collections.Counter()
    innermost = collections.Counter()
    for o in alive[:200]:
        for r in gc.get_referrers(o):
            if r is alive:
                continue
            holders[type(r).__name__] += 1
            if isinstance(r, types.FrameType):
                frames[_where(r)] += 1
                for rr in gc.get_referrers(r):
                    frame_holders[type(rr).__name__] += 1
                if len(innermost) < 50:
                    innermost[_innermost(r)] += 1
    kinds = ", ".join(f"{s} {d} x{n}" for (s, d), n in by_kind.most_common(limit))
    text = (f"{len(alive)} live tensors ({kinds or 'none'}); referred to by "
            f"{dict(holders.most_common(limit))}")
    if frames:
        text += (f"; frames {dict(frames.most_common(limit))}, held by "
                 f"{dict(frame_holders.most_common(limit))}; innermost frames and their "
                 f"holders {dict(innermost.most_common(limit))}")
    return text
