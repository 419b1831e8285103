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


def live_tensors(limit: int = 6) -> str:
    from cuda_backend.tensor import CudaTensor
    gc.collect()
    alive = [o for o in gc.get_objects()
             if isinstance(o, CudaTensor) and getattr(o, "_ptr", None) is not None]
    by_kind = collections.Counter((o.shape, o.dtype.name_str) for o in alive)
    holders = collections.Counter()
    frames = collections.Counter()
    frame_holders = collections.Counter()
    for o in alive[:200]:
        for r in gc.get_referrers(o):
            if r is alive:
                continue
            holders[type(r).__name__] += 1
            if isinstance(r, types.FrameType):
                frames[_where(r)] += 1
                for rr in gc.get_referrers(r):
                    frame_holders[type(rr).__name__] += 1
    kinds = ", ".join(f"{s} {d} x{n}" for (s, d), n in by_kind.most_common(limit))
    text = (f"{len(alive)} live tensors ({kinds or 'none'}); referred to by "
            f"{dict(holders.most_common(limit))}")
    if frames:
        text += (f"; frames {dict(frames.most_common(limit))}, held by "
                 f"{dict(frame_holders.most_common(limit))}")
    return text
