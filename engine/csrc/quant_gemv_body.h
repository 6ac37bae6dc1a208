// The packed kernels over the interleaved layout (quant_packed.h), written once over a vector
// type V and included by one translation unit per instruction set (quant_gemv_avx512.cpp,
// quant_gemv_avx2.cpp, quant_gemv_avxvnni.cpp, quant_gemv_scalar.cpp), each under its own target.
//
// V holds LANES of a group's 16 rows (16 in a zmm, 8 in a ymm, 1 in an int: SLICES = 16 / LANES
// passes); a 4-byte piece of the tile then loads as LANES rows x 4 inputs, and V::dot adds, per
// row, the products of its 4 unsigned weight bytes with 4 int8 activations broadcast to every lane.
// Per block of 32 inputs (16 for Q6_K) that int32 sum is converted once and multiplied by the
// rows' scales times the activation block's scale (x scaled per 16 for a 32-input block: each half
// times its scale of x, summed, then times the rows' scales). A format's unsigned offset (Q4_0's 8, Q6_K's 32,
// Q8_0's 128 after V flips its sign bit) starts the int32 sum at -offset times the block's sum
// of activations, the same for every row; Q4_K's mins multiply that sum in float.
//
// A kernel runs 1 to GEMV_CHUNK_ROWS rows of x, or GEMV_WIDE_ROWS for the 32-input formats on AVX-512 (ROWS,
// a template argument, so their sums live in registers); a call of more rows takes them in chunks over
// each group (`groups`). Each row's sums are the same, in integers and in float, whatever chunk it falls in.
//
// Expects, before inclusion: namespace tiergate_quant's GemvJob / GemvPart (quant_packed.h) and a
// traits struct V.

namespace gemv_body {

using I = typename V::I;
using F = typename V::F;

// Row r's int8 activations as int32 words (word w holds inputs 4w..4w+3).
inline const int32_t* words(const GemvJob& j, int r) { return j.xq + r * (j.in / 4); }

// Row r's activations as a kernel of ROWS rows reads them: GEMV_WIDE_ROWS rows from their interleaved
// chunk (GemvJob::wide), fewer from the rows themselves.
template <int ROWS>
struct Acts {
  static constexpr bool WIDE = ROWS == GEMV_WIDE_ROWS;
  static const int32_t* word(const GemvJob& j, int r, int64_t w) {
    return WIDE ? j.wide.xq + w * ROWS + r : words(j, r) + w;
  }
  static int32_t sum16(const GemvJob& j, int r, int64_t i) {
    return WIDE ? j.wide.xs16[i * ROWS + r] : j.xs16[r * (j.in / 16) + i];
  }
  // -32 times sum16 in a job scaled per 32: Q6_K's start (GemvWide::xs16 holds it so in the wide chunks).
  static int32_t q6_start(const GemvJob& j, int r, int64_t i) {
    return WIDE ? j.wide.xs16[i * ROWS + r] : -32 * j.xs16[r * (j.in / 16) + i];
  }
  static float scale16(const GemvJob& j, int r, int64_t i) {
    return WIDE ? j.wide.xd[i * ROWS + r] : j.xd[r * (j.in / 16) + i];
  }
  static float scale32(const GemvJob& j, int r, int64_t b) {  // x scaled per 32 (GemvJob::per16 false)
    return WIDE ? j.wide.xd[b * ROWS + r] : j.xd[r * (j.in / 32) + b];
  }
  static float scaled_sum(const GemvJob& j, int r, int64_t b) {
    return WIDE ? j.wide.xds[b * ROWS + r] : j.xds[r * (j.in / 32) + b];
  }
};

inline I nibbles_low(I v) { return V::and_(v, V::set1_8(0x0F)); }
inline I nibbles_high(I v) { return V::and_(V::srli16(v, 4), V::set1_8(0x0F)); }

// Asks for a tile ahead of the walk into L2 (prefetcht1), where the hardware's prefetchers fall
// behind it: into L1 the prefetches stalled, the line fill buffers full. Past the group's end
// they fetch the next group's tiles; past the weight's, nothing faults.
// Only a group's first slice asks: the later ones (SLICES > 1: AVX2, scalar) walk the tiles it brought in.
inline void tile_to_l2(const uint8_t* tile, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(tile + at, 0, 2);
}

// The same a vector at a time: each vector of a tile asks for its place in the tile `ahead` bytes on as it
// is read, so the requests stream at the walk's pace instead of a tile's worth at once. Two lines, as a
// 64-byte vector spans two where a tile's size is not a multiple of 64 (Q6_K's 16 x 210 bytes).
inline void vector_to_l2(const uint8_t* vector, int64_t ahead) {
  __builtin_prefetch(vector + ahead, 0, 2);
  __builtin_prefetch(vector + ahead + 63, 0, 2);
}

// The sum of `N` words' 4-byte products for one row (x: the row's words) as int32 lanes, their int16
// pair sums added before one widening (V::PAIR_SUMS). Exact where N pair sums fit int16: weights of at
// most 5 bits unsigned times |x| <= 127 give pairs of at most 7874, so 4 of them; 4-bit weights 8.
// A template on W, so that traits without the pair ops compile where no caller instantiates it.
template <int N, typename W>
typename W::I pair_sums(const typename W::I* u, const int32_t* x) {
  typename W::I p = W::mul_pairs(u[0], W::set1_32(x[0]));
  for (int w = 1; w < N; ++w) p = W::add16(p, W::mul_pairs(u[w], W::set1_32(x[w])));
  return W::widen_pairs(p);
}

template <typename W>
typename W::I widen_pairs(typename W::I p) { return W::widen_pairs(p); }
template <typename W>
typename W::I add_pairs(typename W::I acc, typename W::I u, typename W::I x) { return W::add16(acc, W::mul_pairs(u, x)); }

template <int ROWS>
void store(const GemvJob& j, const GemvPart& p, int64_t first, F (&acc)[ROWS]) {
  const int64_t count = std::min<int64_t>(V::LANES, p.out_features - first);
  for (int r = 0; r < ROWS; ++r) V::store(j.out + r * j.out_stride + p.col0 + first, acc[r], count);
}

// Q4_0, Q4_1, Q5_0, Q5_1 (nibbles: low inputs 0-15, high 16-31; Q5's fifth bits or-ed in) and Q8_0
// (int8, read as unsigned by V::dot_s8). Q4_1's and Q5_1's min m adds m times the block's sum of x, in float.
// A block is walked in halves, words 0-3 then 4-7 (the low and the high nibbles), so that only one half's
// weights and int32 sums are held at a time: at 8 rows, sums for the whole block with the rows' float
// sums beside them outgrew AVX-512's 32 registers, and the float sums went to the stack every block.
// 8 rows (GEMV_WIDE_ROWS) read x from its interleaved chunk, so scaled per 16 (Acts).
// Each row's sums run in CHAINS independent chains (summed at the end), so the dot products' latency
// overlaps where few rows would leave each waiting on the one before; 8 rows are 8 chains already.
// PER16: x has a scale per 16 inputs (GemvJob::per16), one per half; each half's sum is converted as it
// ends and times its scale of x, and the rows' scale d multiplies their sum once: one float multiply a
// row and block fewer than d times each scale of x, which at 8 rows held the dot products back.
// Otherwise the chains run on through both halves and the block's sum is scaled once.
template <int ROWS, int64_t TYPE, bool PER16>
void blocks32(const GemvJob& j, const uint8_t* group, int slice, F (&acc)[ROWS]) {
  constexpr bool Q8 = TYPE == Q8_0, MIN = TYPE == Q4_1 || TYPE == Q5_1, FIVE = TYPE == Q5_0 || TYPE == Q5_1;
  static_assert(PER16 || !Acts<ROWS>::WIDE, "the wide chunks are scaled per 16");
  using X = Acts<ROWS>;
  constexpr int CHAINS = ROWS <= 2 ? 4 : ROWS <= 4 ? 2 : 1;
  const int64_t blocks = j.in / 32, tb = PACK_ROWS * format_of(TYPE).block_bytes;
  const int64_t lanes_at = slice * V::BYTES;
  const int offset = Q8 ? V::S8_OFFSET : MIN ? 0 : FIVE ? 16 : 8;
  const int high_bits = MIN ? 64 : 32;  // Q5's qh follows d (and m) ...
  const int quants = high_bits + (FIVE ? 64 : 0);  // ... and the nibbles or int8 values follow them
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* t = group + b * tb;
    // On one row only where the job asks (row_prefetch): without these a Xeon's core read well short of
    // its memory bandwidth, with them a Zen 4's did (bench/RESULTS.md); q4_k's larger tiles read one row
    // at speed without them on both.
    if (slice == 0 && (ROWS > 1 || j.row_prefetch)) tile_to_l2(t + 8 * tb, tb);
    const F d = V::halves(t + slice * V::LANES * 2);
    const F m = MIN ? V::halves(t + 32 + slice * V::LANES * 2) : V::zero_ps();
    const I qh = FIVE ? V::load(t + high_bits + lanes_at) : V::zero();
    I sum[CHAINS][ROWS];
    F halves[ROWS];  // PER16: the block's halves, each times its scale of x, summed; d scales it once
    for (int h = 0; h < 2; ++h) {
      if (h == 0 || PER16)
        for (int r = 0; r < ROWS; ++r) {
          const int32_t s = PER16 ? X::sum16(j, r, 2 * b + h) : X::sum16(j, r, 2 * b) + X::sum16(j, r, 2 * b + 1);
          sum[0][r] = V::set1_32(-offset * s);
          for (int c = 1; c < CHAINS; ++c) sum[c][r] = V::zero();
        }
      // Word 4h + k of the block's activations (inputs 16h + 4k ..) meets u[k]: LANES rows x 4 bytes.
      I u[4];
      for (int k = 0; k < 4; ++k) {
        if (Q8) {
          u[k] = V::load(t + quants + (4 * h + k) * 64 + lanes_at);
        } else {
          const I v = V::load(t + quants + k * 64 + lanes_at);
          u[k] = h == 0 ? nibbles_low(v) : nibbles_high(v);
        }
        if (FIVE) {  // word w's high bits are at bit w of each byte (quant_packed.h's qh_bit_in_tile)
          const I bit0_of_bytes = V::set1_32(0x01010101);
          u[k] = V::or_(u[k], V::slli32(V::and_(V::srli32(qh, 4 * h + k), bit0_of_bytes), 4));
        }
      }
      if constexpr (V::PAIR_SUMS && !Q8) {  // the half's 4 words summed at once
        for (int r = 0; r < ROWS; ++r)
          sum[h % CHAINS][r] = V::add32(sum[h % CHAINS][r], pair_sums<4, V>(u, words(j, r) + 8 * b + 4 * h));
      } else {
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k)
          for (int r = 0; r < ROWS; ++r) {
            const int32_t* x = X::word(j, r, 8 * b + 4 * h + k);
            I& s = sum[(4 * h + k) % CHAINS][r];
            s = Q8 ? V::dot_s8_at(s, u[k], x) : V::dot_at(s, u[k], x);
          }
      }
      if (PER16 || h == 1)
        for (int r = 0; r < ROWS; ++r) {
          I total = sum[0][r];
          for (int c = 1; c < CHAINS; ++c) total = V::add32(total, sum[c][r]);
          if (!PER16) {
            acc[r] = V::fmadd(V::cvt(total), V::mul(d, V::set1_ps(X::scale32(j, r, b))), acc[r]);
          } else {
            const F xd = V::set1_ps(X::scale16(j, r, 2 * b + h));
            halves[r] = h == 0 ? V::mul(V::cvt(total), xd) : V::fmadd(V::cvt(total), xd, halves[r]);
            if (h == 1) acc[r] = V::fmadd(halves[r], d, acc[r]);
          }
        }
    }
    if (MIN)
      for (int r = 0; r < ROWS; ++r) acc[r] = V::fmadd(m, V::set1_ps(X::scaled_sum(j, r, b)), acc[r]);
  }
}

// blocks32 for x as the job scaled it (per 16 or per 32 inputs).
template <int ROWS, int64_t TYPE>
void blocks32_as_scaled(const GemvJob& j, const uint8_t* group, int slice, F (&acc)[ROWS]) {
  if constexpr (Acts<ROWS>::WIDE) blocks32<ROWS, TYPE, true>(j, group, slice, acc);
  else if (j.per16) blocks32<ROWS, TYPE, true>(j, group, slice, acc);
  else blocks32<ROWS, TYPE, false>(j, group, slice, acc);
}

#include "quant_gemv_body_k.h"

template <int ROWS>
void group_rows(const GemvJob& j, const GemvPart& p, int64_t g) {
  const int64_t blocks = j.in / format_of(p.type).block_values;
  const uint8_t* group = p.packed + g * blocks * tile_bytes(p.type);
  for (int slice = 0; slice < V::SLICES; ++slice) {
    const int64_t first = g * PACK_ROWS + slice * V::LANES;
    if (first >= p.out_features) break;  // a slice of padding rows only
    F acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = V::zero_ps();
    switch (p.type) {
      case Q4_0: blocks32_as_scaled<ROWS, Q4_0>(j, group, slice, acc); break;
      case Q4_1: blocks32_as_scaled<ROWS, Q4_1>(j, group, slice, acc); break;
      case Q5_0: blocks32_as_scaled<ROWS, Q5_0>(j, group, slice, acc); break;
      case Q5_1: blocks32_as_scaled<ROWS, Q5_1>(j, group, slice, acc); break;
      case Q8_0: blocks32_as_scaled<ROWS, Q8_0>(j, group, slice, acc); break;
      case Q4_K:
        if constexpr (Acts<ROWS>::WIDE) q4_k_wide<false>(j, group, slice, acc);
        else q4_k<ROWS>(j, group, slice, acc);
        break;
      case Q5_K:
        if constexpr (Acts<ROWS>::WIDE) q4_k_wide<true>(j, group, slice, acc);
        else q4_k<ROWS, true>(j, group, slice, acc);
        break;
      default: q6_k<ROWS>(j, group, slice, acc); break;
    }
    store<ROWS>(j, p, first, acc);
  }
}

// The job's rows [r0, r0 + rows) as a job of their own.
inline GemvJob rows_of(const GemvJob& j, int64_t r0, int64_t rows) {
  GemvJob c = j;
  c.rows = rows;
  c.xq += r0 * (j.in / 4), c.xd += r0 * (j.in / (j.per16 ? 16 : 32));
  c.xds += r0 * (j.in / 32), c.xs16 += r0 * (j.in / 16);
  c.out += r0 * j.out_stride;
  if (r0 % GEMV_WIDE_ROWS == 0 && j.wide.xq != nullptr) {  // a chunk's start: row r0's index (GemvWide)
    c.wide.xq += r0 * (j.in / 4), c.wide.xd += r0 * (j.in / (j.per16 ? 16 : 32));
    c.wide.xds += r0 * (j.in / 32), c.wide.xs16 += r0 * (j.in / 16);
  } else {
    c.wide = GemvWide{};
  }
  return c;
}

// Rows [r0, r1) of x times group g of part p, GEMV_CHUNK_ROWS rows at a time (or GEMV_WIDE_ROWS, below):
// the group's tiles are read from memory by the first chunk and from the caches by the others.
inline void group_chunks(const GemvJob& j, const GemvPart& p, int64_t g, int64_t r0, int64_t r1) {
  int64_t r = r0;
  // With AVX-512's 32 registers every format takes 8 rows at a time while 8 remain: a tile's weights are
  // unpacked once for 8 rows instead of 4. Not AVX2, with 16 registers. r0 starts a chunk of GemvWide
  // (groups' blocks are whole chunks).
  if constexpr (V::LANES == 16) {
    if (j.wide.xq != nullptr)
      for (; r + GEMV_WIDE_ROWS <= r1; r += GEMV_WIDE_ROWS) group_rows<GEMV_WIDE_ROWS>(rows_of(j, r, GEMV_WIDE_ROWS), p, g);
  }
  for (; r < r1; r += GEMV_CHUNK_ROWS) {
    const GemvJob c = rows_of(j, r, std::min(GEMV_CHUNK_ROWS, r1 - r));
    switch (c.rows) {
      case 1: group_rows<1>(c, p, g); break;
      case 2: group_rows<2>(c, p, g); break;
      case 3: group_rows<3>(c, p, g); break;
      default: group_rows<4>(c, p, g); break;
    }
  }
}

// Groups [g0, g1) of the job, numbered across its parts in order, for every row: a block of rows
// (quant_packed.h's GEMV_BLOCK_BYTES of activations, whole chunks) passes over all the groups
// before the next block does.
inline void groups(const GemvJob& j, int64_t g0, int64_t g1) {
  static_assert(GEMV_CHUNK_ROWS == 4, "group_chunks instantiates the kernels for 1 to 4 rows");
  static_assert(GEMV_WIDE_ROWS % GEMV_CHUNK_ROWS == 0, "a block is whole chunks of either");
  const int64_t block = std::max<int64_t>(1, GEMV_BLOCK_BYTES / j.in / GEMV_WIDE_ROWS) * GEMV_WIDE_ROWS;
  for (int64_t r0 = 0; r0 < j.rows; r0 += block) {
    const int64_t r1 = std::min(j.rows, r0 + block);
    int64_t base = 0;
    for (int pi = 0; pi < j.nparts && g0 < g1; ++pi) {
      const GemvPart& p = j.parts[pi];
      const int64_t n = (p.out_features + PACK_ROWS - 1) / PACK_ROWS;
      const GemvJob& jp = j.per16_job != nullptr && per16_scales(p.type) ? *j.per16_job : j;
      for (int64_t g = std::max(g0, base); g < std::min(g1, base + n); ++g) group_chunks(jp, p, g - base, r0, r1);
      base += n;
    }
  }
}

}  // namespace gemv_body
