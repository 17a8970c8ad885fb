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
  bool panels;  // rows in 16-row panels (kernels/quant.py), not the file's order
};

struct Blob {
  int64_t K, N;
  std::vector<Part> parts;
  bool panels;  // every part in 16-row panels
};

constexpr int64_t kPanelRows = 16, kQ4_0Id = 2, kQ4_1Id = 3, kQ5_0Id = 6, kQ5_1Id = 7;
constexpr int64_t kQ4KId = 12, kQ5KId = 13, kQ6KId = 14;
constexpr int64_t kQ4KBytes = 144, kQ5KBytes = 176, kQ6KBytes = 210;
constexpr int64_t kPanelChunk = kPanelRows * kQ4KBytes, kQ6KPanelChunk = kPanelRows * kQ6KBytes;
constexpr int64_t kQ5KPanelChunk = kPanelRows * kQ5KBytes;
constexpr int64_t kMaxBlockBytes = 210;  // a row_block buffer: the largest block (Q6_K's)
// Where a Q6_K panel's fields start in its super-block (kernels/quant.py):
// ql words at 0, qh words, the int8 scales, the rows' d.
constexpr int64_t kQ6KPanelQh = 2048, kQ6KPanelScales = 3072, kQ6KPanelD = 3328;

// A panel's fields, in the block's order (kernels/quant.py's PANEL_FIELDS):
// field f holds bytes [start, start + bytes) of each of the 16 rows' blocks,
// `word` bytes of one row beside the same word of the next.
struct PanelField {
  int start, bytes, word;
};
inline const std::vector<PanelField>& panel_fields(int64_t type) {
  static const std::vector<PanelField> q4k{{0, 4, 4}, {4, 12, 1}, {16, 128, 4}};
  static const std::vector<PanelField> q5k{{0, 4, 4}, {4, 12, 1}, {16, 32, 4}, {48, 128, 4}};
  static const std::vector<PanelField> q6k{{0, 128, 4}, {128, 64, 4}, {192, 16, 1}, {208, 2, 2}};
  static const std::vector<PanelField> q4_0{{0, 2, 2}, {2, 16, 4}};
  static const std::vector<PanelField> q4_1{{0, 2, 2}, {2, 2, 2}, {4, 16, 4}};
  static const std::vector<PanelField> q5_0{{0, 2, 2}, {2, 4, 4}, {6, 16, 4}};
  static const std::vector<PanelField> q5_1{{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}};
  switch (type) {
    case kQ5KId: return q5k;
    case kQ6KId: return q6k;
    case kQ4_0Id: return q4_0;
    case kQ4_1Id: return q4_1;
    case kQ5_0Id: return q5_0;
    case kQ5_1Id: return q5_1;
    default: return q4k;
  }
}

// The families whose types may share a blob in panels (kernels/quant.py's
// PANEL_FAMILIES): 1 the K-quants, 2 the legacy 4- and 5-bit types, 0 neither.
inline int panel_family(int64_t type) {
  if (type == kQ4KId || type == kQ5KId || type == kQ6KId) return 1;
  if (type == kQ4_0Id || type == kQ4_1Id || type == kQ5_0Id || type == kQ5_1Id) return 2;
  return 0;
}

inline Blob parse(const at::Tensor& blob) {
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.dim() == 1 && blob.is_contiguous() &&
                  blob.numel() >= 64,
              "quant_linear: the weight must be a quantized blob (kernels/quant.py)");
  const auto* base = blob.data_ptr<uint8_t>();
  int64_t words[8];
  std::memcpy(words, base, sizeof(words));
  TORCH_CHECK(words[0] == 0x57515350 && words[1] == 1, "quant_linear: not a version-1 blob");
  TORCH_CHECK((words[5] & ~int64_t(1)) == 0, "quant_linear: unknown blob flags ", words[5]);
  Blob b{words[2], words[3], {}, (words[5] & 1) != 0};
  int64_t rows = 0;
  int family = -1;  // the first part's panel family
  for (int64_t p = 0; p < words[4]; ++p) {
    int64_t w[4];
    std::memcpy(w, base + 8 * (8 + 4 * p), sizeof(w));
    TORCH_CHECK(w[2] + w[1] * w[3] <= blob.numel(), "quant_linear: a part runs past the blob");
    if (family < 0) family = panel_family(w[0]);
    TORCH_CHECK(!b.panels || (family > 0 && panel_family(w[0]) == family && w[1] % kPanelRows == 0),
                "quant_linear: 16-row panels hold parts of whole panels, all Q4_K, Q5_K or Q6_K or all "
                "Q4_0, Q4_1, Q5_0 or Q5_1, got type ", w[0], ", ", w[1], " rows");
    b.parts.push_back(Part{w[0], w[1], w[3], base + w[2], b.panels});
    rows += w[1];
  }
  TORCH_CHECK(rows == b.N, "quant_linear: the parts hold ", rows, " rows, the header says ", b.N);
  return b;
}

// Row r's block b as the file stores it: in place, or (a part in panels)
// gathered out of its panel into `buf` (kMaxBlockBytes), the layout
// kernels/quant.py draws undone.
inline const uint8_t* row_block(const Part& p, int64_t r, int64_t b, int64_t block_bytes, uint8_t* buf) {
  if (!p.panels) return p.data + r * p.row_bytes + b * block_bytes;
  const uint8_t* chunk = p.data + (r / kPanelRows) * kPanelRows * p.row_bytes + b * kPanelRows * block_bytes;
  const int64_t l = r % kPanelRows;
  for (const PanelField& f : panel_fields(p.type)) {
    for (int w = 0; w < f.bytes / f.word; ++w)
      std::memcpy(buf + f.start + w * f.word, chunk + (w * kPanelRows + l) * f.word, f.word);
    chunk += kPanelRows * f.bytes;
  }
  return buf;
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
