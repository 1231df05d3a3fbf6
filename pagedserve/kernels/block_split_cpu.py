"""Blocks of work split over OpenMP threads, a thread that finishes early taking what is left of
another's share, as C++ text that the CPU kernels compile in (pagedserve/kernels/linear_cpu.py).

split_blocks(blocks, threads, body) calls body(blk, more) once for each blk in [0, blocks): each
thread walks its own even range in order (so it can ask for its next block's data ahead; `more`
says the range holds a block after blk), then takes blocks from the front of the others' ranges.
On a shared machine one core is often slowed by other work for a while; with a static split the
call waits for that core's whole share (BENCHMARKS.md, issue 44). Tested through the kernels
against torch (tests/unit/kernels/test_linear_cpu.py).
"""

SOURCE = r"""
#include <atomic>
#include <cstdint>
#include <vector>
#include <omp.h>

template <class Body>
static void split_blocks(int64_t blocks, int64_t threads, Body body) {
  struct alignas(64) Range { std::atomic<int64_t> next; int64_t end; };
  const int64_t T = threads < 1 ? 1 : threads;
  std::vector<Range> ranges(T);
  for (int64_t t = 0; t < T; t++) { ranges[t].next = blocks * t / T; ranges[t].end = blocks * (t + 1) / T; }
#pragma omp parallel num_threads(T) if (T > 1)
  {
    const int64_t me = omp_get_thread_num();
    for (int64_t o = 0; o < T; o++) {
      Range& r = ranges[(me + o) % T];
      for (int64_t blk; (blk = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) body(blk, blk + 1 < r.end);
    }
  }
}
"""
