"""Does a Python frame that launched a kernel through bare PyCUDA outlive its call under
compute-sanitizer? Each step keeps a marker object in a local and launches one kernel; after
the loop (synchronized, garbage collected) the script counts markers still alive.

    python3 perf/frames_under_sanitizer.py
    compute-sanitizer --tool memcheck python3 perf/frames_under_sanitizer.py
"""
import gc
import struct
import weakref

import pycuda.autoinit  # noqa: F401
import pycuda.driver as drv
from pycuda.compiler import SourceModule

SRC = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }'


class Marker:
    pass


def main() -> None:
    f = SourceModule(SRC, no_extern_c=True).get_function("k")
    f.prepare("P")
    buf = drv.mem_alloc(1024)
    refs = []

    def prepared():
        m = Marker()
        refs.append(weakref.ref(m))
        f.prepared_call((1, 1), (32, 1, 1), buf)

    def raw():
        m = Marker()
        refs.append(weakref.ref(m))
        f._launch_kernel((1, 1, 1), (32, 1, 1), struct.pack("P", int(buf)), 0, None)

    def no_launch():
        m = Marker()
        refs.append(weakref.ref(m))

    for step in (prepared, raw, no_launch):
        refs.clear()
        for _ in range(200):
            step()
        drv.Context.synchronize()
        gc.collect()
        alive = sum(r() is not None for r in refs)
        print(f"{step.__name__}: {alive} of {len(refs)} markers alive after their frames returned")


if __name__ == "__main__":
    main()
