// The K formats' packed kernels (Q4_K, Q5_K, Q6_K: super-blocks of 256 inputs), part of quant_gemv_body.h:
// included by it inside its namespace, after the 32-input formats' kernels, and under the same
// expectations (a traits struct V, GemvJob, `words`). Split off to keep each file readable at one sitting.

// Byte `byte` of each 32-bit lane, unsigned, as float.
inline F byte_of(I v, int byte) { return V::cvt(V::and_(V::srli32(v, 8 * byte), V::set1_32(0xFF))); }

// quant_formats.h's scale_min_k4 on 16 rows at once. A K tile's pieces at 64, 128 and 192 (w0, w1, w2) hold
// in lane r row r's scale bytes 0-11: the sub-blocks' 6-bit scales are six_bits_k(w0, w2), their mins
// six_bits_k(w1, w2 >> 4), sub-block s's in byte s % 4 of piece s / 4 of the result.
inline void six_bits_k(I low, I nibbles, I (&out)[2]) {
  out[0] = V::and_(low, V::set1_8(0x3F));
  out[1] = V::or_(V::and_(nibbles, V::set1_8(0x0F)), V::slli32(V::and_(V::srli32(low, 6), V::set1_8(0x03)), 4));
}

// Q4_K, and Q5_K (FIVE) whose fifth bits come from its qh pieces: bit 2c of a byte tops the low nibble of the
// nibbles' byte in the same place of chunk c's pieces, bit 2c + 1 the high one.
template <int ROWS, bool FIVE = false>
void q4_k(const GemvJob& j, const uint8_t* group, int slice, F (&acc)[ROWS]) {
  const int64_t supers = j.in / 256, tb = PACK_ROWS * (FIVE ? 176 : 144);
  const int64_t nibbles_at = FIVE ? 768 : 256;  // past d, dmin, the scales (and qh)
  const int64_t lanes_at = slice * V::BYTES;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* t = group + sb * tb;
    // Past one row, or with Q5_K's fifth bits, the vector work slows the walk enough that the hardware's
    // prefetchers fell behind, so the tile two ahead is asked for; one row of Q4_K reads at memory speed
    // without, and lost a little with it. On AVX-512 the nibbles are asked for a vector at a time as they
    // are read, faster than the tile at once (bench/RESULTS.md, 2026-11-29, "a vector at a time").
    constexpr bool ask_ahead = ROWS > 1 || FIVE, by_vector = ask_ahead && V::LANES == 16;
    if (by_vector) tile_to_l2(t + 2 * tb, nibbles_at);  // d, dmin, the scales and qh: read first
    else if (ask_ahead && slice == 0) tile_to_l2(t + 2 * tb, tb);
    const F d = V::halves(t + slice * V::LANES * 2), dmin = V::halves(t + 32 + slice * V::LANES * 2);
    const I w0 = V::load(t + 64 + lanes_at), w1 = V::load(t + 128 + lanes_at), w2 = V::load(t + 192 + lanes_at);
    I scales[2], mins[2];
    six_bits_k(w0, w2, scales);
    six_bits_k(w1, V::srli32(w2, 4), mins);
    F sums[ROWS], offs[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = offs[r] = V::zero_ps();
    I qh[8];  // Q5_K: its qh pieces, read once for the four chunks
    if (FIVE)
      for (int k = 0; k < 8; ++k) qh[k] = V::load(t + 256 + k * 64 + lanes_at);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      I lo[ROWS], hi[ROWS];
      for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = V::zero();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const I v = V::load(t + nibbles_at + (c * 8 + k) * 64 + lanes_at);
        if (by_vector) __builtin_prefetch(t + 2 * tb + nibbles_at + (c * 8 + k) * 64, 0, 2);  // lines: tb % 64 == 0
        I l = nibbles_low(v), h = nibbles_high(v);
        if (FIVE) {
          // Bits 2c and 2c + 1 of each byte to bit 4 by one shift within the 32-bit lane each (what crosses from a
          // neighbouring byte never lands on bit 4), then masked and or-ed in (one vpternlogd on AVX-512).
          const I bit4_of_bytes = V::set1_8(0x10);
          const I low_top = 2 * c <= 4 ? V::slli32(qh[k], 4 - 2 * c) : V::srli32(qh[k], 2 * c - 4);
          const I high_top = 2 * c + 1 <= 4 ? V::slli32(qh[k], 3 - 2 * c) : V::srli32(qh[k], 2 * c - 3);
          l = V::or_(l, V::and_(low_top, bit4_of_bytes));
          h = V::or_(h, V::and_(high_top, bit4_of_bytes));
        }
        for (int r = 0; r < ROWS; ++r) {
          const int32_t* x = words(j, r) + 64 * sb + 16 * c;
          if constexpr (V::PAIR_SUMS && !FIVE) {  // int16 pair sums of the 8 words (4-bit: pair_sums), widened below
            lo[r] = add_pairs<V>(lo[r], l, V::set1_32(x[k]));
            hi[r] = add_pairs<V>(hi[r], h, V::set1_32(x[8 + k]));
          } else {
            lo[r] = V::dot_at(lo[r], l, x + k);
            hi[r] = V::dot_at(hi[r], h, x + 8 + k);
          }
        }
      }
      if constexpr (V::PAIR_SUMS && !FIVE)
        for (int r = 0; r < ROWS; ++r) lo[r] = widen_pairs<V>(lo[r]), hi[r] = widen_pairs<V>(hi[r]);
      const int s0 = 2 * c, s1 = 2 * c + 1;
      const F sc0 = byte_of(scales[s0 / 4], s0 % 4), sc1 = byte_of(scales[s1 / 4], s1 % 4);
      const F m0 = byte_of(mins[s0 / 4], s0 % 4), m1 = byte_of(mins[s1 / 4], s1 % 4);
      for (int r = 0; r < ROWS; ++r) {
        const float* xd = j.xd + r * (j.in / 32) + 8 * sb;
        const float* xds = j.xds + r * (j.in / 32) + 8 * sb;
        sums[r] = V::fmadd(V::cvt(lo[r]), V::mul(sc0, V::set1_ps(xd[s0])), sums[r]);
        sums[r] = V::fmadd(V::cvt(hi[r]), V::mul(sc1, V::set1_ps(xd[s1])), sums[r]);
        offs[r] = V::fmadd(m0, V::set1_ps(xds[s0]), offs[r]);
        offs[r] = V::fmadd(m1, V::set1_ps(xds[s1]), offs[r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) acc[r] = V::fnmadd(dmin, offs[r], V::fmadd(d, sums[r], acc[r]));
  }
}

// q4_k on GEMV_WIDE_ROWS rows of interleaved x (GemvWide, scaled per 32), on AVX-512: each word of nibbles
// is unpacked once for 8 rows where two 4-row chunks unpacked it twice. Many rows are bound by the vector
// instructions, not the bytes, and at 4 rows the unpacking and scaling were most of them. To fit the
// registers, the sub-blocks are walked one at a time (8 rows' int32 sums beside their 8 float sums), and the
// mins' offsets are added once the super-block's sums are done. The same sums and float steps, in the same
// order, as q4_k's: each row's result is the same bits. (q6_k walks its parts one at a time already: at
// 8 rows it reads x through Acts, as it does at fewer.)
template <bool FIVE>
void q4_k_wide(const GemvJob& j, const uint8_t* group, int slice, F (&acc)[GEMV_WIDE_ROWS]) {
  constexpr int R = GEMV_WIDE_ROWS;
  using X = Acts<R>;
  const int64_t supers = j.in / 256, tb = PACK_ROWS * (FIVE ? 176 : 144);
  const int64_t nibbles_at = FIVE ? 768 : 256;
  const int64_t lanes_at = slice * V::BYTES;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* t = group + sb * tb;
    if (slice == 0) tile_to_l2(t + 2 * tb, tb);
    const F d = V::halves(t + slice * V::LANES * 2), dmin = V::halves(t + 32 + slice * V::LANES * 2);
    const I w0 = V::load(t + 64 + lanes_at), w1 = V::load(t + 128 + lanes_at), w2 = V::load(t + 192 + lanes_at);
    I scales[2];
    six_bits_k(w0, w2, scales);
    F sums[R];
    for (int r = 0; r < R; ++r) sums[r] = V::zero_ps();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {  // sub-block s: chunk s / 2's low (even s) or high nibbles
      I dots[R];
      for (int r = 0; r < R; ++r) dots[r] = V::zero();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const I v = V::load(t + nibbles_at + ((s / 2) * 8 + k) * 64 + lanes_at);
        I u = s % 2 ? nibbles_high(v) : nibbles_low(v);
        if (FIVE) {  // bit s of each qh byte to bit 4, as q4_k does
          const I qh = V::load(t + 256 + k * 64 + lanes_at);
          const I top = s <= 4 ? V::slli32(qh, 4 - s) : V::srli32(qh, s - 4);
          u = V::or_(u, V::and_(top, V::set1_8(0x10)));
        }
        for (int r = 0; r < R; ++r) dots[r] = V::dot_at(dots[r], u, X::word(j, r, 64 * sb + 8 * s + k));
      }
      const F sc = byte_of(scales[s / 4], s % 4);
      for (int r = 0; r < R; ++r)
        sums[r] = V::fmadd(V::cvt(dots[r]), V::mul(sc, V::set1_ps(X::scale32(j, r, 8 * sb + s))), sums[r]);
    }
    I mins[2];
    six_bits_k(w1, V::srli32(w2, 4), mins);
    F m[8];
    for (int s = 0; s < 8; ++s) m[s] = byte_of(mins[s / 4], s % 4);
    for (int r = 0; r < R; ++r) {
      F offs = V::zero_ps();
      for (int s = 0; s < 8; ++s) offs = V::fmadd(m[s], V::set1_ps(X::scaled_sum(j, r, 8 * sb + s)), offs);
      acc[r] = V::fnmadd(dmin, offs, V::fmadd(d, sums[r], acc[r]));
    }
  }
}

// Inputs 128h + 32s + l (l < 32) of a Q6_K super-block: nibble s / 2 of ql byte 64h + 32(s % 2) + l,
// bits 2s of qh byte 32h + l. H and S are template arguments so every shift and mask is a constant:
// as loop counters they left the compiler a variable shift and a choice of nibble per step.
// Part (H, S)'s values of one word as unsigned bytes, from its ql vector `low` and qh vector `high`.
template <int S>
I q6_values(I low, I high) {
  const I nib = V::and_(S / 2 ? V::srli16(low, 4) : low, V::set1_8(0x0F));
  // Bits 2S, 2S + 1 of each qh byte to bits 4, 5 (shifts within a 32-bit lane; the mask drops what
  // crossed from the neighbouring byte).
  const I top = V::and_(S == 0 ? V::slli32(high, 4) : S == 1 ? V::slli32(high, 2) : S == 2 ? high : V::srli32(high, 2),
                        V::set1_8(0x30));
  return V::or_(nib, top);
}

// Part (H, S)'s int32 sums, `first` (l < 16) and `second`, started at -32 times x's sums.
template <int ROWS, int H, int S>
void q6_k_start(const GemvJob& j, int64_t sb, I (&first)[ROWS], I (&second)[ROWS]) {
  using X = Acts<ROWS>;
  for (int r = 0; r < ROWS; ++r) {
    first[r] = V::set1_32(X::q6_start(j, r, 16 * sb + 8 * H + 2 * S));
    second[r] = V::set1_32(X::q6_start(j, r, 16 * sb + 8 * H + 2 * S + 1));
  }
}

// Word k of part (H, S) (values v) into its sums.
template <int ROWS, int H, int S>
void q6_k_word(const GemvJob& j, int64_t sb, int k, I v, I (&first)[ROWS], I (&second)[ROWS]) {
  for (int r = 0; r < ROWS; ++r) {
    const int32_t* x = Acts<ROWS>::word(j, r, 64 * sb + 32 * H + 8 * S + k);
    if (k < 4) first[r] = V::dot_at(first[r], v, x);
    else second[r] = V::dot_at(second[r], v, x);
  }
}

// Part (H, S)'s sums times its int8 scales and x's scale, into `sums`.
template <int ROWS, int H, int S>
void q6_k_scale(const GemvJob& j, const uint8_t* scales, int64_t sb, int64_t lanes_at, const I (&first)[ROWS],
                const I (&second)[ROWS], F (&sums)[ROWS]) {
  constexpr int sub = 8 * H + 2 * S;  // the 16-input sub-blocks of l < 16 and l >= 16
  // int8 scales sub and sub + 1: bytes sub % 4 and sub % 4 + 1 of piece sub / 4, sign-extended.
  const I sc = V::load(scales + (sub / 4) * 64 + lanes_at);
  const F sc0 = V::cvt(V::srai32(V::slli32(sc, 24 - 8 * (sub % 4)), 24));
  const F sc1 = V::cvt(V::srai32(V::slli32(sc, 24 - 8 * (sub % 4 + 1)), 24));
  for (int r = 0; r < ROWS; ++r) {
    const F xd = V::set1_ps(Acts<ROWS>::scale32(j, r, 8 * sb + 4 * H + S));
    sums[r] = V::fmadd(V::cvt(first[r]), V::mul(sc0, xd), sums[r]);
    sums[r] = V::fmadd(V::cvt(second[r]), V::mul(sc1, xd), sums[r]);
  }
}

// `ahead`: where not 0, the bytes on to the tile whose vectors are asked for as these are read
// (vector_to_l2); parts 0 and 1 read every ql vector of the half between them, part 0 every qh one.
template <int ROWS, int H, int S>
void q6_k_part(const GemvJob& j, const uint8_t* ql, const uint8_t* qh, const uint8_t* scales, int64_t sb,
               int64_t lanes_at, int64_t ahead, F (&sums)[ROWS]) {
  I first[ROWS], second[ROWS];
  q6_k_start<ROWS, H, S>(j, sb, first, second);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const I low = V::load(ql + (16 * H + 8 * (S % 2) + k) * 64 + lanes_at);
    const I high = V::load(qh + (8 * H + k) * 64 + lanes_at);
    if (ahead && S == 0) vector_to_l2(ql + (16 * H + k) * 64, ahead), vector_to_l2(qh + (8 * H + k) * 64, ahead);
    if (ahead && S == 1) vector_to_l2(ql + (16 * H + 8 + k) * 64, ahead);
    q6_k_word<ROWS, H, S>(j, sb, k, q6_values<S>(low, high), first, second);
  }
  q6_k_scale<ROWS, H, S>(j, scales, sb, lanes_at, first, second, sums);
}

// The four parts of half H in one pass, for a row or two on AVX-512 (their 8 or 16 sums fit beside the
// weights): each ql vector is read once for its two nibbles and each qh vector once for its four pairs of
// bits, where the parts one by one read them two and four times, and one row ran at three quarters of the
// memory's speed, bound by those reads and the masks (bench/RESULTS.md). The same sums and float steps in
// the same order as the parts one by one.
template <int ROWS, int H>
void q6_k_half(const GemvJob& j, const uint8_t* ql, const uint8_t* qh, const uint8_t* scales, int64_t sb,
               int64_t lanes_at, int64_t ahead, F (&sums)[ROWS]) {
  I first[4][ROWS], second[4][ROWS];
  q6_k_start<ROWS, H, 0>(j, sb, first[0], second[0]);
  q6_k_start<ROWS, H, 1>(j, sb, first[1], second[1]);
  q6_k_start<ROWS, H, 2>(j, sb, first[2], second[2]);
  q6_k_start<ROWS, H, 3>(j, sb, first[3], second[3]);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const I low_even = V::load(ql + (16 * H + k) * 64 + lanes_at), low_odd = V::load(ql + (16 * H + 8 + k) * 64 + lanes_at);
    const I high = V::load(qh + (8 * H + k) * 64 + lanes_at);
    vector_to_l2(ql + (16 * H + k) * 64, ahead);
    vector_to_l2(ql + (16 * H + 8 + k) * 64, ahead);
    vector_to_l2(qh + (8 * H + k) * 64, ahead);
    q6_k_word<ROWS, H, 0>(j, sb, k, q6_values<0>(low_even, high), first[0], second[0]);
    q6_k_word<ROWS, H, 1>(j, sb, k, q6_values<1>(low_odd, high), first[1], second[1]);
    q6_k_word<ROWS, H, 2>(j, sb, k, q6_values<2>(low_even, high), first[2], second[2]);
    q6_k_word<ROWS, H, 3>(j, sb, k, q6_values<3>(low_odd, high), first[3], second[3]);
  }
  q6_k_scale<ROWS, H, 0>(j, scales, sb, lanes_at, first[0], second[0], sums);
  q6_k_scale<ROWS, H, 1>(j, scales, sb, lanes_at, first[1], second[1], sums);
  q6_k_scale<ROWS, H, 2>(j, scales, sb, lanes_at, first[2], second[2], sums);
  q6_k_scale<ROWS, H, 3>(j, scales, sb, lanes_at, first[3], second[3], sums);
}

template <int ROWS>
void q6_k(const GemvJob& j, const uint8_t* group, int slice, F (&acc)[ROWS]) {
  const int64_t supers = j.in / 256, tb = PACK_ROWS * 210;
  const int64_t lanes_at = slice * V::BYTES;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* t = group + sb * tb;
    // The parts read ql and qh in turns, jumping back and forth within the tile, and the hardware's
    // prefetchers did not follow them from memory: one row ran at a third of Q4_K's bytes a second.
    // On AVX-512 the ql and qh vectors are asked for one at a time as they are read (vector_to_l2), which
    // read faster than the whole tile at once (bench/RESULTS.md, 2026-11-29, "a vector at a time"); here
    // only d and the scales.
    constexpr bool by_vector = V::LANES == 16;
    const int64_t ahead = by_vector ? 2 * tb : 0;
    if (by_vector) tile_to_l2(t + ahead, 32 + 256);
    else if (slice == 0) tile_to_l2(t + 2 * tb, tb);
    const F d = V::halves(t + slice * V::LANES * 2);
    const uint8_t* scales = t + 32;  // 4 pieces: lane r holds row r's int8 scales 4i..4i+3
    const uint8_t* ql = t + 32 + 256;
    const uint8_t* qh = ql + 2048;
    F sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = V::zero_ps();
    if constexpr (V::LANES == 16 && ROWS <= 2) {
      q6_k_half<ROWS, 0>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_half<ROWS, 1>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
    } else {
      q6_k_part<ROWS, 0, 0>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 0, 1>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 0, 2>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 0, 3>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 1, 0>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 1, 1>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 1, 2>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
      q6_k_part<ROWS, 1, 3>(j, ql, qh, scales, sb, lanes_at, ahead, sums);
    }
    for (int r = 0; r < ROWS; ++r) acc[r] = V::fmadd(d, sums[r], acc[r]);
  }
}
