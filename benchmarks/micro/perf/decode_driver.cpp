// A perf driver for the CPU decode kernels (no Python, no torch): one SmolLM2 layer (9/3 heads x 64,
// block 16, batch 64) over a shuffled block table, the fp32 kernel (mode 0) or the int8 one (mode 1), called
// `iters` times; prints the best and mean thread CPU time of the calls after the first. Why: perf sees the
// kernel's own symbols, and variants can be A/B-ed without a build cache. Environment knobs that locate costs:
// SEQ=1 an in-order block table; HOT=n every sequence reads the same n blocks (compute only, no misses);
// HUGE=1 the caches madvised to transparent huge pages. Build and profile (JOURNAL.md, "int8 decode profile"):
//   g++ -O3 -g -fopenmp -std=c++17 -march=x86-64-v3 -mtune=native \
//       -DATT='"$PWD/backends/cpu/attention.cpp"' benchmarks/micro/perf/decode_driver.cpp -o /tmp/drv
//   /tmp/drv 1 10 [ctx] [threads];  perf record -e cpu-clock -F 5000 /tmp/drv 1 60
#include ATT
#include <cstdio>
#include <cstdlib>
#include <random>
#include <ctime>
#include <sys/mman.h>
// 2 MiB-aligned buffers, madvised to huge pages under HUGE=1 before anything touches them.
template <class T>
struct HugeAlloc {
  using value_type = T;
  HugeAlloc() = default;
  template <class U>
  HugeAlloc(const HugeAlloc<U>&) {}
  T* allocate(size_t n) {
    const size_t huge = size_t{2} << 20, bytes = (n * sizeof(T) + huge - 1) / huge * huge;
    void* p = aligned_alloc(huge, bytes);
    if (getenv("HUGE")) madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
};
template <class T, class U>
bool operator==(const HugeAlloc<T>&, const HugeAlloc<U>&) { return true; }
template <class T, class U>
bool operator!=(const HugeAlloc<T>&, const HugeAlloc<U>&) { return false; }

int main(int argc, char** argv) {
  const int mode = atoi(argv[1]);  // 0 fp32, 1 int8
  const int iters = atoi(argv[2]);
  const int ctx = argc > 3 ? atoi(argv[3]) : 2048;
  const int threads = argc > 4 ? atoi(argv[4]) : 1;
  const int B = 64, H = 9, KV = 3, D = 64, BS = 16;
  const int per = (ctx + BS - 1) / BS, nb = B * per;
  std::mt19937 rng(0);
  std::vector<int32_t> tables(nb);
  for (int i = 0; i < nb; ++i) tables[i] = i;
  if (!getenv("SEQ")) std::shuffle(tables.begin(), tables.end(), rng);
  if (getenv("HOT")) for (int i = 0; i < nb; ++i) tables[i] = i % atoi(getenv("HOT"));
  std::vector<float> q(B * H * D), out(B * H * D);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  std::vector<int32_t> lens(B, ctx), ctxl(B, ctx - 1), qsl(B + 1);
  for (int i = 0; i <= B; ++i) qsl[i] = i;
  std::vector<float,HugeAlloc<float>> kf, vf;
  std::vector<int8_t,HugeAlloc<int8_t>> k8, v8;
  const int64_t rows = (int64_t)nb * BS * KV;
  if (mode == 0) {
    kf.resize(rows * D); vf.resize(rows * D);
    for (auto& x : kf) x = nd(rng);
    for (auto& x : vf) x = nd(rng);
  } else {
    const int rb = pagedkv_int8::row_bytes(D);
    k8.resize(rows * rb); v8.resize(rows * rb);
    for (int64_t r = 0; r < rows; ++r)
      for (auto* c : {&k8, &v8}) {
        int8_t* p = c->data() + r * rb;
        for (int d = 0; d < D; ++d) p[d] = (int8_t)(rng() % 255 - 127);
        uint16_t s = 0x3c00;  // bf16 ~ 0.0078
        memcpy(p + D, &s, 2);
      }
  }
  if (FILE* f = fopen("/proc/self/smaps_rollup", "r")) {  // whether HUGE=1 got its huge pages
    char line[256];
    while (fgets(line, sizeof(line), f)) if (strstr(line, "AnonHuge")) fputs(line, stdout);
    fclose(f);
  }
  double best = 1e9, tot = 0;
  for (int it = 0; it < iters; ++it) {
    timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    if (mode == 0)
      pagedkv_cpu_attend(0, q.data(), H * D, D, kf.data(), vf.data(), out.data(), tables.data(), per, ctxl.data(),
                         qsl.data(), B, H, KV, D, BS, 0.125f, 0, 0.0f, 16, threads, 3);
    else
      pagedkv_cpu_decode_int8(q.data(), H * D, D, k8.data(), v8.data(), out.data(), tables.data(), per, lens.data(), B,
                              H, KV, D, BS, 0.125f, 0, 0.0f, threads);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    double ms = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) * 1e-6;
    if (it > 0) { best = std::min(best, ms); tot += ms; }
  }
  printf("mode %d ctx %d: best %.2f ms mean %.2f ms out[0]=%g\n", mode, ctx, best, tot / (iters - 1), out[0]);
}
