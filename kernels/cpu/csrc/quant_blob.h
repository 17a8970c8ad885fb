// The quantized-weight blob as the kernels read it (kernels/quant.py writes
// it): a header of int64 words, then each part's rows of GGUF blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedserve {
namespace quant {

struct Part {
  int64_t type, rows, row_bytes;
  const uint8_t* data;
};

struct Blob {
  int64_t K, N;
  std::vector<Part> parts;
};

inline Blob parse(const at::Tensor& blob) {
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.dim() == 1 && blob.is_contiguous() &&
                  blob.numel() >= 64,
              "quant_linear: the weight must be a quantized blob (kernels/quant.py)");
  const auto* base = blob.data_ptr<uint8_t>();
  int64_t words[8];
  std::memcpy(words, base, sizeof(words));
  TORCH_CHECK(words[0] == 0x57515350 && words[1] == 1, "quant_linear: not a version-1 blob");
  Blob b{words[2], words[3], {}};
  int64_t rows = 0;
  for (int64_t p = 0; p < words[4]; ++p) {
    int64_t w[4];
    std::memcpy(w, base + 8 * (8 + 4 * p), sizeof(w));
    TORCH_CHECK(w[2] + w[1] * w[3] <= blob.numel(), "quant_linear: a part runs past the blob");
    b.parts.push_back(Part{w[0], w[1], w[3], base + w[2]});
    rows += w[1];
  }
  TORCH_CHECK(rows == b.N, "quant_linear: the parts hold ", rows, " rows, the header says ", b.N);
  return b;
}

// Rows [n0, n1) of one part, whose row 0 is output row `first`.
struct Strip {
  const Part* part;
  int64_t first, n0, n1;
};

// Every part's rows in strips of `rows` (a part's last one may be shorter),
// one list for the blob: a region's threads then take q's, k's and v's strips
// alike (work_items.h), where a region per part split each in two.
inline std::vector<Strip> strips_of(const Blob& b, int64_t rows) {
  std::vector<Strip> out;
  int64_t first = 0;
  for (const Part& p : b.parts) {
    for (int64_t n0 = 0; n0 < p.rows; n0 += rows) out.push_back({&p, first, n0, std::min(p.rows, n0 + rows)});
    first += p.rows;
  }
  return out;
}

}  // namespace quant
}  // namespace pagedserve
