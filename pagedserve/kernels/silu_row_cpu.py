"""silu(g) * u over one row, as C++ text that the CPU kernels compile in: the SiLU-and-multiply
pass (pagedserve/kernels/fused_cpu.py) and the gate/up projection that applies it to its own
output (pagedserve/kernels/linear_cpu.py). One text, so both round alike: exp is Cephes'
single-precision polynomial over eight lanes in GCC/Clang vector types (about 1 ulp; AVX2 or
wider, the compiler's default target splits them), written out where a plain loop's clamp
would not vectorize on AVX2. Tested through both kernels against torch
(tests/unit/kernels/test_fused_cpu.py, test_linear_cpu.py).
"""

SOURCE = r"""
#include <cstdint>
#include <cstring>

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

// exp(x) for x clamped to [-87, 88], Cephes' single-precision polynomial (about 1 ulp).
static inline f8 exp8(f8 x) {
    const f8 lo = f8{} - 87.f, hi = f8{} + 88.f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const f8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // rounded (1.5 * 2^23)
    const f8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    f8 p = f8{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
    f8 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// o[i] = silu(g[i]) * u[i] for i < n; o may be g (each 8 lanes are read before they are written).
static inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f8 gv, uv;
        std::memcpy(&gv, g + i, sizeof gv);
        std::memcpy(&uv, u + i, sizeof uv);
        const f8 ov = gv / (1.f + exp8(-gv)) * uv;
        std::memcpy(o + i, &ov, sizeof ov);
    }
    if (i < n) {  // the tail, fewer than 8
        f8 gv = {}, uv = {};
        for (int64_t j = i; j < n; ++j) gv[j - i] = g[j], uv[j - i] = u[j];
        const f8 ov = gv / (1.f + exp8(-gv)) * uv;
        for (int64_t j = i; j < n; ++j) o[j] = ov[j - i];
    }
}
"""
