/* dlion's CPU kernels: the elementwise passes of a Lion / D-Lion step and the bit codec's
 * inner loops, each one loop over memory, many tensors per call.
 *
 * Exactness: compiled with -ffp-contract=off and without -ffast-math, so every product and
 * sum is rounded once, in the order written, as eager PyTorch rounds the same operations
 * (tests/test_kernels.py compares value for value, NaN, infinities, subnormals and signed
 * zeros included). -fno-trapping-math only lets comparisons be vectorised; it changes no value.
 *
 * Every "segment" argument is an array of per-tensor pointers with a length each: one call
 * serves a whole bucket or parameter group, so the cost follows values, not tensors.
 */
#include <stddef.h>
#include <stdint.h>

#define CHUNK ((int64_t)1 << 16)

/* dlion.kernels builds without -fopenmp (a second OpenMP runtime beside torch's is asking for
 * trouble): the chunks then run one after another on the calling thread and nt is unused. */
#if defined(_OPENMP)
#define PARALLEL_CHUNKS _Pragma("omp parallel for if(nch > 1 && nt > 1) num_threads(nt) schedule(static)")
#else
#define PARALLEL_CHUNKS (void)nt;
#endif

/* Split [0, n) into CHUNK-sized pieces, spread over nt threads where there are several. */
#define FOR_CHUNKS(n, BODY)                                        \
  do {                                                             \
    int64_t nch = ((n) + CHUNK - 1) / CHUNK;                       \
    PARALLEL_CHUNKS                                                \
    for (int64_t k = 0; k < nch; k++) {                            \
      int64_t lo = k * CHUNK, hi = lo + CHUNK < (n) ? lo + CHUNK : (n); \
      BODY                                                         \
    }                                                              \
  } while (0)

void dl_pack_positive(const int8_t *restrict v, int64_t n, uint8_t *restrict out);
int64_t dl_count_zeros(const int8_t *restrict v, int64_t n);

#define DEFINE(T, S, MAXV)                                                                          \
  /* p <- p*decay - lr*sign(b1*m + s1*g);  m <- b2*m + s2*g   (the Lion rule, per tensor) */         \
  static void lion_range_##S(T *restrict p, T *restrict m, const T *restrict g, int64_t n, T decay, \
                             T lr, T b1, T s1, T b2, T s2) {                                        \
    for (int64_t i = 0; i < n; i++) {                                                               \
      T c = m[i] * b1 + g[i] * s1;                                                                  \
      T sg = (T)((c > 0) - (c < 0));                                                                \
      p[i] = p[i] * decay - lr * sg;                                                                \
      m[i] = m[i] * b2 + g[i] * s2;                                                                 \
    }                                                                                               \
  }                                                                                                 \
  void dl_lion_##S(int ns, T **p, T **m, T **g, const int64_t *len, T decay, T lr, T b1, T s1,      \
                   T b2, T s2, int nt) {                                                            \
    for (int s = 0; s < ns; s++) {                                                                  \
      T *pp = p[s], *mm = m[s]; const T *gg = g[s];                                                 \
      FOR_CHUNKS(len[s], lion_range_##S(pp + lo, mm + lo, gg + lo, hi - lo, decay, lr, b1, s1, b2, s2);); \
    }                                                                                               \
  }                                                                                                 \
  /* o <- sign(b1*m + s1*g) as int8, or 2 where that is not finite; whether any was not finite */   \
  static int sign_range_##S(const T *restrict m, const T *restrict g, int8_t *restrict o, int64_t n, \
                            T b1, T s1) {                                                           \
    int bad = 0;                                                                                    \
    for (int64_t i = 0; i < n; i++) {                                                               \
      T c = m[i] * b1 + g[i] * s1;                                                                  \
      int v = (c > 0) - (c < 0);                                                                    \
      int nf = !(c <= MAXV && c >= -MAXV);                                                          \
      bad |= nf;                                                                                    \
      o[i] = (int8_t)(nf ? 2 : v);                                                                  \
    }                                                                                               \
    return bad;                                                                                     \
  }                                                                                                 \
  /* The signs of a whole bucket and its 1-bit payload, block by block so that packing reads what   \
   * was just written: values[0, padded) <- the signs of the segments (at offsets off), 0 elsewhere; \
   * packed <- bits of values > 0; *zeros <- how many of values[0, numel) are 0. One thread. */      \
  int dl_sign_pack_##S(int ns, T **m, T **g, const int64_t *off, const int64_t *len, T b1, T s1,    \
                       int8_t *values, int64_t padded, int64_t numel, uint8_t *packed,               \
                       int64_t *zeros) {                                                            \
    const int64_t block = 8 * 4096;                                                                 \
    int bad = 0, s = 0;                                                                             \
    int64_t z = 0;                                                                                  \
    for (int64_t lo = 0; lo < padded; lo += block) {                                                \
      int64_t hi = lo + block < padded ? lo + block : padded;                                       \
      __builtin_memset(values + lo, 0, (size_t)(hi - lo));                                          \
      for (int t = s; t < ns && off[t] < hi; t++) {                                                 \
        int64_t a = off[t] > lo ? off[t] : lo, e = off[t] + len[t] < hi ? off[t] + len[t] : hi;     \
        if (a < e) bad |= sign_range_##S(m[t] + (a - off[t]), g[t] + (a - off[t]), values + a, e - a, \
                                         b1, s1);                                                   \
        if (off[t] + len[t] <= hi && t == s) s++;                                                   \
      }                                                                                             \
      dl_pack_positive(values + lo, hi - lo, packed + lo / 8);                                      \
      if (lo < numel) z += dl_count_zeros(values + lo, (numel < hi ? numel : hi) - lo);             \
    }                                                                                               \
    *zeros = z;                                                                                     \
    return !bad;                                                                                    \
  }                                                                                                 \
  /* m <- b2*m + s2*g */                                                                            \
  static void momentum_range_##S(T *restrict m, const T *restrict g, int64_t n, T b2, T s2) {       \
    for (int64_t i = 0; i < n; i++) m[i] = m[i] * b2 + g[i] * s2;                                   \
  }                                                                                                 \
  void dl_momentum_##S(int ns, T **m, T **g, const int64_t *len, T b2, T s2, int nt) {              \
    for (int s = 0; s < ns; s++) {                                                                  \
      T *mm = m[s]; const T *gg = g[s];                                                             \
      FOR_CHUNKS(len[s], momentum_range_##S(mm + lo, gg + lo, hi - lo, b2, s2););                   \
    }                                                                                               \
  }                                                                                                 \
  /* p <- p*decay - lr*code, code int8 in {-1, 0, 1} (lr*code is exact) */                          \
  static void codes_range_##S(T *restrict p, const int8_t *restrict c, int64_t n, T decay, T lr) {  \
    for (int64_t i = 0; i < n; i++) p[i] = p[i] * decay - lr * (T)c[i];                             \
  }                                                                                                 \
  void dl_apply_codes_##S(int ns, T **p, int8_t **codes, const int64_t *len, T decay, T lr, int nt) { \
    for (int s = 0; s < ns; s++) {                                                                  \
      T *pp = p[s]; const int8_t *cc = codes[s];                                                    \
      FOR_CHUNKS(len[s], codes_range_##S(pp + lo, cc + lo, hi - lo, decay, lr););                   \
    }                                                                                               \
  }

DEFINE(float, f32, 3.40282347e+38f)
DEFINE(double, f64, 1.7976931348623157e+308)

/* Bit codec: bit i of out (little-endian within each byte) <- v[i] > 0; n a multiple of 8. */
void dl_pack_positive(const int8_t *restrict v, int64_t n, uint8_t *restrict out) {
  for (int64_t j = 0; j < n / 8; j++) {
    const int8_t *b = v + 8 * j;
    out[j] = (uint8_t)((b[0] > 0) | (b[1] > 0) << 1 | (b[2] > 0) << 2 | (b[3] > 0) << 3 |
                       (b[4] > 0) << 4 | (b[5] > 0) << 5 | (b[6] > 0) << 6 | (b[7] > 0) << 7);
  }
}

/* dl_pack_positive, and how many of v[0..count) are 0, in the same pass over memory (block by
 * block: the count reads what the packing just brought into the cache). */
int64_t dl_count_zeros(const int8_t *restrict v, int64_t n);
void dl_pack_positive(const int8_t *restrict v, int64_t n, uint8_t *restrict out);
int64_t dl_pack_positive_count_zeros(const int8_t *restrict v, int64_t n, uint8_t *restrict out, int64_t count) {
  int64_t z = 0;
  const int64_t block = 8 * 4096;
  for (int64_t i = 0; i < n; i += block) {
    int64_t m = n - i < block ? n - i : block;
    dl_pack_positive(v + i, m, out + i / 8);
    if (i < count) z += dl_count_zeros(v + i, count - i < m ? count - i : m);
  }
  return z;
}

/* How many of v[0..n) are 0: byte counters over blocks of 255 rows of 64 (no overflow), which
 * vectorise as byte compares and adds. */
int64_t dl_count_zeros(const int8_t *restrict v, int64_t n) {
  int64_t z = 0, i = 0;
  const int64_t block = 255 * 64;
  for (; i + block <= n; i += block) {
    uint8_t acc[64] = {0};
    for (int64_t r = 0; r < block; r += 64)
      for (int k = 0; k < 64; k++) acc[k] += v[i + r + k] == 0;
    for (int k = 0; k < 64; k++) z += acc[k];
  }
  for (; i < n; i++) z += v[i] == 0;
  return z;
}

static int8_t sign_rows[256][8];
static float sign_rows_f32[256][8];
static double sign_rows_f64[256][8];

/* Called once, when the library is loaded (before any thread can use the tables). */
void dl_init(void) {
  for (int b = 0; b < 256; b++)
    for (int k = 0; k < 8; k++) {
      int v = ((b >> k) & 1) ? 1 : -1;
      sign_rows[b][k] = (int8_t)v;
      sign_rows_f32[b][k] = (float)v;
      sign_rows_f64[b][k] = (double)v;
    }
}

/* p <- p*decay - lr*s with s = +1 where bit (start + i) of bits is set, else -1: the update from
 * 1-bit codes without decoding them (8 values per packed byte, from a table of +-1 rows). */
#define DEFINE_SIGNS(T, S)                                                                          \
  typedef T row8_##S __attribute__((vector_size(8 * sizeof(T))));                                   \
  static void signs_range_##S(T *restrict p, const uint8_t *restrict bits, int64_t nbytes, T decay,  \
                              T lr) {                                                               \
    row8_##S vd = {decay, decay, decay, decay, decay, decay, decay, decay};                        \
    row8_##S vl = {lr, lr, lr, lr, lr, lr, lr, lr};                                                 \
    for (int64_t j = 0; j < nbytes; j++) {                                                          \
      row8_##S x, r;                                                                                \
      __builtin_memcpy(&x, p + 8 * j, sizeof x);                                                    \
      __builtin_memcpy(&r, sign_rows_##S[bits[j]], sizeof r);                                       \
      x = x * vd - vl * r; /* (two products, each rounded: -ffp-contract=off) */                    \
      __builtin_memcpy(p + 8 * j, &x, sizeof x);                                                    \
    }                                                                                               \
  }                                                                                                 \
  void dl_apply_signs_##S(int ns, T **p, const int64_t *start, const int64_t *len,                  \
                          const uint8_t *bits, T decay, T lr, int nt) {                             \
    for (int s = 0; s < ns; s++) {                                                                  \
      T *pp = p[s]; int64_t at = start[s], n = len[s], i = 0;                                       \
      for (; i < n && (at + i) % 8; i++)                                                            \
        pp[i] = pp[i] * decay - lr * sign_rows_##S[bits[(at + i) / 8]][(at + i) % 8];               \
      int64_t body = (n - i) / 8;                                                                   \
      T *q = pp + i; const uint8_t *bb = bits + (at + i) / 8;                                       \
      int64_t nbytes = body;                                                                        \
      FOR_CHUNKS(nbytes, signs_range_##S(q + 8 * lo, bb + lo, hi - lo, decay, lr););                \
      for (i += 8 * body; i < n; i++)                                                               \
        pp[i] = pp[i] * decay - lr * sign_rows_##S[bits[(at + i) / 8]][(at + i) % 8];               \
    }                                                                                               \
  }

DEFINE_SIGNS(float, f32)
DEFINE_SIGNS(double, f64)

/* out[i] <- +1 where bit i of packed is set, else -1, for i < n: 8 bytes copied per packed byte. */
void dl_unpack_signs(const uint8_t *restrict packed, int64_t n, int8_t *restrict out) {
  int64_t full = n / 8;
  for (int64_t j = 0; j < full; j++) __builtin_memcpy(out + 8 * j, sign_rows[packed[j]], 8);
  for (int64_t i = 8 * full; i < n; i++) out[i] = sign_rows[packed[i / 8]][i % 8];
}

/* Majority vote on packed bits (the bit-sliced adder of dlion.bitvote, 256 columns at a time):
 * rows[r] holds voter r's w packed bits (1 = +1). Per bit column, count = voters with the bit set;
 * gt <- count > t, eq <- count == t (t = N/2 rounded down), and over the first `real` columns
 * counts[0] = how many have count 0 or N (unanimous), counts[1] = how many count == t with N even
 * (tied). N at most 255. */
typedef uint64_t u64x4 __attribute__((vector_size(32)));
/* (the helpers take and return vectors through pointers: without -mavx, a 32-byte vector passed
 * by value draws a note on its calling convention from gcc) */

static void load_block(u64x4 *x, const uint8_t *p, int64_t avail) {
  *x = (u64x4){0, 0, 0, 0};
  __builtin_memcpy(x, p, avail >= 32 ? 32 : (size_t)avail);
}

static void equal_to(u64x4 *eq, const u64x4 *planes, int np, int t) {
  *eq = (u64x4){~0ULL, ~0ULL, ~0ULL, ~0ULL};
  for (int k = 0; k < np; k++) *eq &= ((t >> k) & 1) ? planes[k] : ~planes[k];
}

static int64_t popcount_live(const u64x4 *x, int64_t first_bit, int64_t real) {
  int64_t total = 0;
  for (int l = 0; l < 4; l++) {
    int64_t bits = real - (first_bit + 64 * l);
    uint64_t live = bits >= 64 ? ~0ULL : bits > 0 ? ((1ULL << bits) - 1) : 0;
    total += __builtin_popcountll((*x)[l] & live);
  }
  return total;
}

void dl_majority(int N, const uint8_t **rows, int64_t w, int64_t real, uint8_t *gt, uint8_t *eq, int64_t *counts) {
  int np = 0;
  while ((1 << np) <= N) np++;
  int t = N / 2;
  int64_t unanimous = 0, tied = 0;
  for (int64_t j = 0; j < w; j += 32) {
    int64_t avail = w - j;
    u64x4 planes[8];
    for (int k = 0; k < np; k++) planes[k] = (u64x4){0, 0, 0, 0};
    for (int r = 0; r < N; r++) {
      u64x4 carry;
      load_block(&carry, rows[r] + j, avail);
      for (int k = 0; k < np; k++) {
        u64x4 p = planes[k];
        planes[k] = p ^ carry;
        carry = p & carry;
      }
    }
    u64x4 g = {0, 0, 0, 0}, e = {~0ULL, ~0ULL, ~0ULL, ~0ULL};  /* count > t, count == t: from the top bit */
    for (int k = np - 1; k >= 0; k--) {
      if ((t >> k) & 1) e &= planes[k];
      else { g |= e & planes[k]; e &= ~planes[k]; }
    }
    if (8 * j < real) {
      u64x4 none, all;
      equal_to(&none, planes, np, 0);
      equal_to(&all, planes, np, N);
      none |= all;
      unanimous += popcount_live(&none, 8 * j, real);
      if (N % 2 == 0) tied += popcount_live(&e, 8 * j, real);
    }
    __builtin_memcpy(gt + j, &g, avail >= 32 ? 32 : (size_t)avail);
    __builtin_memcpy(eq + j, &e, avail >= 32 ? 32 : (size_t)avail);
  }
  counts[0] = unanimous;
  counts[1] = tied;
}
