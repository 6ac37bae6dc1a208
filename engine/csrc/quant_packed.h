// The interleaved layout some block formats are repacked into at load (quant_gemv.cpp's kernels
// read it at every row count; the AMX panels, quant_dequant_panel.cpp, unpack a group of it back
// into ggml rows).
//
// Output rows go in groups of PACK_ROWS = 16. A group's block b (the same inputs of its 16
// rows) is one tile of 16 * block_bytes bytes: each field of the block (a run of `len` bytes
// at `offset`) is cut into pieces of `piece` bytes, and the tile holds, piece by piece, that
// piece of row 0, row 1, ..., row 15. With 4-byte pieces, 64 consecutive bytes are 16 rows x 4
// bytes: one AVX-512 vector whose 32-bit lane r holds row r's bytes, so one dpbusd multiplies
// 16 rows by 4 inputs of x broadcast; with 2-byte pieces a float16 field of the 16 rows lies
// side by side for one vcvtph2ps. Only bytes move, so the values are the file's: unpacking
// gives the ggml bytes back exactly. One exception, undone as exactly: Q5_0's and Q5_1's 32 high
// bits (qh, bit i tops input i) are reordered within their word so that the 4 bits of the 4 inputs
// of one 4-byte piece of nibbles sit at bit w of each byte (qh_bit_in_tile), for 3 shifts and masks.
//
// The packed tensor is uint8 [groups, blocks, 16 * block_bytes]; the rows of the last group
// past the weight's outputs are zero bytes (scale zero), computed and not stored.
#pragma once

#include "quant_formats.h"

#include <cstdint>
#include <cstring>

namespace tiergate_quant {

constexpr int64_t PACK_ROWS = 16;

struct Field {
  int offset, len, piece;
  bool high_bits = false;  // Q5's qh word, reordered in the tile (reorder_qh)
};

struct Layout {
  int fields;
  Field field[5];
};

inline bool repacked(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K || type == Q5_K ||
         type == Q6_K;
}

// Fields in tile order; each kernel reads them at the offsets this order gives (tile_offsets).
constexpr Layout layout_of(int64_t type) {
  switch (type) {
    case Q4_0: return {2, {{0, 2, 2}, {2, 16, 4}}};  // d; nibbles (low: inputs 0-15, high: 16-31)
    case Q8_0: return {2, {{0, 2, 2}, {2, 32, 4}}};  // d; int8 quants
    case Q4_K: return {4, {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 4}}};  // d; dmin; 6-bit scales, mins; nibbles
    // Q5_K: as Q4_K, with qh (bit 2c / 2c + 1 of byte l: the fifth bit of the low / high nibble of qs byte 32c + l)
    // before the nibbles: a 4-byte piece of qh holds the bits of the same bytes l as a piece of nibbles.
    case Q5_K: return {5, {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 32, 4}, {48, 128, 4}}};
    case Q4_1: return {3, {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}}};  // d; m; nibbles
    case Q5_0: return {3, {{0, 2, 2}, {2, 4, 4, true}, {6, 16, 4}}};  // d; high bits; nibbles
    case Q5_1: return {4, {{0, 2, 2}, {2, 2, 2}, {4, 4, 4, true}, {8, 16, 4}}};  // d; m; high bits; nibbles
    default: return {4, {{208, 2, 2}, {192, 16, 4}, {0, 128, 4}, {128, 64, 4}}};  // Q6_K: d; int8 scales; ql; qh
  }
}

inline int64_t tile_bytes(int64_t type) { return PACK_ROWS * format_of(type).block_bytes; }

// Where field f's first piece sits in a tile.
inline int64_t tile_offset(int64_t type, int f) {
  const Layout l = layout_of(type);
  int64_t at = 0;
  for (int i = 0; i < f; ++i) at += PACK_ROWS * l.field[i].len;
  return at;
}

// Where Q5_0's / Q5_1's high bit of input i goes in the tile's word: input i is byte i % 4 of word
// i / 4 of the block's activations (the kernel's words: 0-3 low nibbles, 4-7 high), so the bits
// that word w needs sit at bit w of each byte; a shift right by w and a mask bring them to bit 0.
constexpr int qh_bit_in_tile(int i) { return 8 * (i % 4) + i / 4; }

inline uint32_t reorder_qh(uint32_t qh, bool pack) {
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) {
    const int from = pack ? i : qh_bit_in_tile(i), to = pack ? qh_bit_in_tile(i) : i;
    out |= ((qh >> from) & 1u) << to;
  }
  return out;
}

// Copies one block of one row between the ggml form (`block`) and its place in a tile: into the
// tile when `pack`, out of it otherwise.
inline void move_block(int64_t type, uint8_t* tile, int64_t row, uint8_t* block, bool pack) {
  const Layout l = layout_of(type);
  int64_t at = 0;
  for (int f = 0; f < l.fields; ++f) {
    const Field& fd = l.field[f];
    for (int p = 0; p < fd.len / fd.piece; ++p) {
      uint8_t* in_tile = tile + at + (p * PACK_ROWS + row) * fd.piece;
      uint8_t* in_block = block + fd.offset + p * fd.piece;
      if (fd.high_bits) {
        uint32_t qh;
        std::memcpy(&qh, pack ? in_block : in_tile, 4);
        qh = reorder_qh(qh, pack);
        std::memcpy(pack ? in_tile : in_block, &qh, 4);
      } else if (pack) {
        std::memcpy(in_tile, in_block, fd.piece);
      } else {
        std::memcpy(in_block, in_tile, fd.piece);
      }
    }
    at += PACK_ROWS * fd.len;
  }
}

// The 16 ggml rows of packed group `group` (rows of `blocks` blocks), into `rows` [16, row bytes].
inline void unpack_group(int64_t type, const uint8_t* packed, int64_t blocks, int64_t group, uint8_t* rows) {
  const int64_t tb = tile_bytes(type), bb = format_of(type).block_bytes, row_bytes = blocks * bb;
  const uint8_t* g = packed + group * blocks * tb;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r = 0; r < PACK_ROWS; ++r)
      move_block(type, const_cast<uint8_t*>(g + b * tb), r, rows + r * row_bytes + b * bb, false);
}

// One call of the packed kernels (quant_gemv*.cpp): `rows` rows of x quantized to int8 per 32
// inputs, times packed weights side by side. A group of 16 outputs meets the rows GEMV_CHUNK_ROWS
// at a time (the most whose sums the registers hold beside the weight's), and rows in blocks of
// about GEMV_BLOCK_BYTES of int8 activations: every chunk of a block passes over the group while
// its bytes are in L1/L2, and the block's activations stay in L2 while the thread's groups pass.
constexpr int64_t GEMV_CHUNK_ROWS = 4;
constexpr int64_t GEMV_BLOCK_BYTES = 256 * 1024;
// On AVX-512 every format takes GEMV_WIDE_ROWS rows at a time while that many remain
// (quant_gemv_body.h's group_chunks), reading them from GemvWide.
constexpr int64_t GEMV_WIDE_ROWS = 8;

// x as GemvJob's arrays (scaled per 16 or 32 inputs, as the job), with each chunk of GEMV_WIDE_ROWS rows interleaved:
// value i of the chunk's row r at [chunk][i][r], so a chunk's rows are read at fixed offsets from one
// pointer. With a pointer per row, 8 rows' pointers and sums outgrew the registers and went to the stack.
// A chunk of rows starting at row r0 starts at the same index as row r0 in the row-major arrays.
struct GemvWide {
  const int32_t* xq = nullptr;    // [chunks, in / 4, 8]
  const float* xd = nullptr;      // [chunks, in / 16, 8], or in / 32 where the job is scaled per 32
  const float* xds = nullptr;     // [chunks, in / 32, 8]
  // [chunks, in / 16, 8]: the sums per 16 inputs; where the job is scaled per 32 (the K formats', of which
  // only Q6_K reads them) -32 times the sums, the start of Q6_K's sums, broadcast from memory as they are.
  const int32_t* xs16 = nullptr;
};

struct GemvPart {
  const uint8_t* packed;
  int64_t type, out_features, col0;  // col0: the part's first column of out
};

struct GemvJob {
  const GemvPart* parts;
  int nparts;
  int64_t rows, in;
  const int32_t* xq;    // [rows, in / 4]: int8 activations, 4 to a word
  const float* xd;      // [rows, in / 32]: each block's scale ([rows, in / 16] per 16 inputs when per16)
  const float* xds;     // [rows, in / 32]: the block's sum of int8 values times their scales
  const int32_t* xs16;  // [rows, in / 16]: sums of int8 values per 16 inputs
  float* out;
  int64_t out_stride;
  bool per16;  // x was quantized with a scale per 16 inputs (per16_scales)
  // Where the call also has parts of per16_scales' formats and this job is scaled per 32: the same
  // rows of x scaled per 16, which those parts read.
  const GemvJob* per16_job;
  // The 32-input formats' kernel asks for its tiles ahead on one row of x too (past one row it always
  // does): the caller's choice, as it pays on some cores and costs on others (engine/quant_linear.py).
  bool row_prefetch;
  // The whole chunks of GEMV_WIDE_ROWS rows interleaved, where the job runs on AVX-512; null pointers
  // elsewhere.
  GemvWide wide;
};

// Whether a part's kernel reads x with a scale per 16 inputs instead of 32: the 32-input formats, whose
// kernel sums a block's two halves apart and scales each by its own. Half the activation rounding for
// a few more multiplies keeps the Q4_1 file's logprobs as close to its exact weights as llama.cpp's
// (tests/engine/test_gguf_native_quality.py); the K formats' kernels read one scale per 32 inputs.
inline bool per16_scales(int64_t type) { return format_of(type).block_values == 32; }

// Groups [g0, g1) of the job's outputs (numbered across parts, PACK_ROWS outputs each) on one
// instruction set: AVX-512 VNNI, AVX2 with AVX-VNNI's dpbusd, AVX2 with maddubs, or plain C++.
void gemv_groups_avx512(const GemvJob& job, int64_t g0, int64_t g1);
void gemv_groups_avxvnni(const GemvJob& job, int64_t g0, int64_t g1);
void gemv_groups_avx2(const GemvJob& job, int64_t g0, int64_t g1);
void gemv_groups_scalar(const GemvJob& job, int64_t g0, int64_t g1);

// x [rows, in] (rows x_stride apart) times the packed parts, into their columns of out. Every
// part must be packed; isa: quant_linear.cpp's numbering; row_prefetch: GemvJob's.
void gemv_packed(const float* x, int64_t x_stride, int64_t rows, int64_t in, const GemvPart* parts, int nparts,
                 int64_t isa, bool row_prefetch, float* out, int64_t out_stride);

}  // namespace tiergate_quant
