// e^x as 2^(x log2 e), shared by every build, and
// 2^f on [-0.5, 0.5]: the degree-6 polynomial both AVX builds evaluate by
// Horner's rule (highest power first); relative error ~2e-7.  One table, so
// the two builds cannot drift apart.
#pragma once

namespace pagedserve {

constexpr float kLog2e = 1.4426950408889634f;  // e^x = 2^(x * log2(e))

constexpr float kExp2Poly[7] = {
    1.5403530393381608e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
    5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

}  // namespace pagedserve
