/*
 * The CPU reductions of one tensor in a few passes of compiled code, with the GIL released.
 *
 * On the CPU a sampled tensor's statistics came from a score of numpy and torch calls a tensor
 * (block sums, extremes, zero counts, a gather, a sort, the binning passes). Each call releases
 * the GIL and takes it back, and while the reduction worker makes them the training thread waits
 * for the GIL after its own operations; the Python between them holds it outright. Here one call
 * does a tensor's whole default profile: a pass for the sums, extremes and zeros, the grid of its
 * histogram and a pass for the bins, and the order statistics of its quartile subsample.
 *
 * What it must agree with, bit for bit: the histogram grid and bins of ``_host_binning`` and
 * ``_binning`` (the same float operations in the working dtype, in the same order; compiled with
 * -ffp-contract=off so that no multiply-add is fused), and the order statistics of ``np.sort``
 * (a radix selection among the same entries: the same values, a -0.0 and a 0.0 aside, which compare
 * equal and may trade places). The sums are accumulated in double per lane, so
 * they are at least as accurate as the blocked float32 sums they replace, not equal to them.
 *
 * Arguments are addresses and sizes given by ``reducers/_native.py``, which owns every buffer and
 * checks every tensor (dense, contiguous, float32 or float64, on the CPU) before it gets here.
 * The limited API keeps one build per platform for every Python from 3.11 on.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Runtime dispatch of the streaming loops to AVX-512 or AVX2 where the processor has them: the
   wheel is built for the baseline ISA, where converting to double costs twice the time. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TI_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TI_CLONES
#endif

#if defined(_MSC_VER)
#define TI_NOINLINE __declspec(noinline)
#elif defined(__GNUC__)
#define TI_NOINLINE __attribute__((noinline))
#else
#define TI_NOINLINE
#endif

#define LANES 16
#define ZERO_BLOCK 65536 /* entries per lane counter flush: a uint32 lane never overflows */
#define BIN_LANES 8       /* copies of the bin table, so repeats of one bin do not serialize */
#define BIN_CHUNK 256

enum { STATUS_OK = 0, STATUS_NONFINITE = 1, STATUS_BIN_OVERFLOW = 2 };
enum { DTYPE_FLOAT32 = 0, DTYPE_FLOAT64 = 1 };

typedef struct {
    double total;   /* sum of the entries */
    double squares; /* sum of their squares */
    double lo;      /* smallest entry */
    double hi;      /* largest entry */
    double zeros;   /* entries equal to zero */
} Summary;

/* ---- one pass: sums, sum of squares, extremes, zero count ------------------------------- */

#define DEFINE_SUMMARY(NAME, T)                                                                \
    TI_CLONES static void NAME(const T* x, int64_t n, Summary* s) {                            \
        double total[LANES] = {0}, squares[LANES] = {0};                                       \
        T lo[LANES], hi[LANES];                                                                \
        uint32_t zero[LANES] = {0};                                                            \
        int64_t zeros = 0, i = 0;                                                              \
        for (int j = 0; j < LANES; j++) {                                                      \
            lo[j] = (T)INFINITY;                                                               \
            hi[j] = (T)-INFINITY;                                                              \
        }                                                                                      \
        while (n - i >= LANES) {                                                               \
            int64_t stop = i + (n - i) / LANES * LANES;                                        \
            if (stop - i > ZERO_BLOCK) stop = i + ZERO_BLOCK;                                  \
            for (; i < stop; i += LANES) {                                                     \
                for (int j = 0; j < LANES; j++) {                                              \
                    T v = x[i + j];                                                            \
                    double d = (double)v;                                                      \
                    total[j] += d;                                                             \
                    squares[j] += d * d;                                                       \
                    lo[j] = v < lo[j] ? v : lo[j];                                             \
                    hi[j] = v > hi[j] ? v : hi[j];                                             \
                    zero[j] += (v == (T)0);                                                    \
                }                                                                              \
            }                                                                                  \
            for (int j = 0; j < LANES; j++) {                                                  \
                zeros += zero[j];                                                              \
                zero[j] = 0;                                                                   \
            }                                                                                  \
        }                                                                                      \
        double t = 0.0, q = 0.0;                                                               \
        T mn = (T)INFINITY, mx = (T)-INFINITY;                                                 \
        for (int j = 0; j < LANES; j++) {                                                      \
            t += total[j];                                                                     \
            q += squares[j];                                                                   \
            mn = lo[j] < mn ? lo[j] : mn;                                                      \
            mx = hi[j] > mx ? hi[j] : mx;                                                      \
        }                                                                                      \
        for (; i < n; i++) {                                                                   \
            T v = x[i];                                                                        \
            t += (double)v;                                                                    \
            q += (double)v * (double)v;                                                        \
            mn = v < mn ? v : mn;                                                              \
            mx = v > mx ? v : mx;                                                              \
            zeros += (v == (T)0);                                                              \
        }                                                                                      \
        s->total = t;                                                                          \
        s->squares = q;                                                                        \
        s->lo = (double)mn;                                                                    \
        s->hi = (double)mx;                                                                    \
        s->zeros = (double)zeros;                                                              \
    }

DEFINE_SUMMARY(summary_f32, float)
DEFINE_SUMMARY(summary_f64, double)

/* ---- Adam's gradient-to-second-moment ratio: sum of g^2 c / max(v, floor c) ---------------- */

/* The sum of g[i]^2 / max(v[i] / c, floor) over i, as g[i]^2 c / max(v[i], floor c) in double
   (c > 0: the same value, one division an entry), without the temporaries torch's expression
   makes (each one fresh memory the size of the tensor). A NaN in ``v`` stays NaN (max keeps
   it), as torch's clamp keeps it. */
#define DEFINE_RATIO(NAME, T)                                                                  \
    TI_CLONES static double NAME(const T* g, const T* v, int64_t n, double c, double bound) {  \
        double sums[LANES] = {0};                                                              \
        int64_t i = 0;                                                                         \
        for (; n - i >= LANES; i += LANES) {                                                   \
            for (int j = 0; j < LANES; j++) {                                                  \
                double x = (double)g[i + j], s = (double)v[i + j];                             \
                s = s < bound ? bound : s;                                                     \
                sums[j] += x * x * c / s;                                                      \
            }                                                                                  \
        }                                                                                      \
        double total = 0.0;                                                                    \
        for (int j = 0; j < LANES; j++) total += sums[j];                                      \
        for (; i < n; i++) {                                                                   \
            double x = (double)g[i], s = (double)v[i];                                         \
            s = s < bound ? bound : s;                                                         \
            total += x * x * c / s;                                                            \
        }                                                                                      \
        return total;                                                                          \
    }

DEFINE_RATIO(ratio_f32, float)
DEFINE_RATIO(ratio_f64, double)

/* ---- an update and its sum of squares: out = after - before, sum of out^2 in double ------- */

/* One pass where torch's ``sub`` and ``linalg.vector_norm`` make two: each entry's difference is
   rounded to T once, as torch's is (``out`` may be ``before``: each entry is read before it is
   written), and squared and summed in double per lane, as the summary's squares are. A NaN or an
   infinity in a difference makes the sum NaN or infinite, as it makes torch's norm. */
#define DEFINE_DIFFERENCE(NAME, T)                                                             \
    TI_CLONES static double NAME(const T* after, const T* before, T* out, int64_t n) {         \
        double sums[LANES] = {0};                                                              \
        int64_t i = 0;                                                                         \
        T d[LANES];                                                                            \
        for (; n - i >= LANES; i += LANES) {                                                   \
            /* a block read whole before it is written: ``out`` may alias the inputs */        \
            for (int j = 0; j < LANES; j++) d[j] = after[i + j] - before[i + j];               \
            for (int j = 0; j < LANES; j++) {                                                  \
                out[i + j] = d[j];                                                             \
                sums[j] += (double)d[j] * (double)d[j];                                        \
            }                                                                                  \
        }                                                                                      \
        double total = 0.0;                                                                    \
        for (int j = 0; j < LANES; j++) total += sums[j];                                      \
        for (; i < n; i++) {                                                                   \
            T last = after[i] - before[i];                                                     \
            out[i] = last;                                                                     \
            total += (double)last * (double)last;                                              \
        }                                                                                      \
        return total;                                                                          \
    }

DEFINE_DIFFERENCE(difference_f32, float)
DEFINE_DIFFERENCE(difference_f64, double)

/* ---- the moments' second pass: squares about a shift ------------------------------------- */

/* The sum of (x[i] - shift)^2 in double: where the mean is large against the spread, the first
   pass's sum of squares less the squared total cancels (``functional.host_moment_values``). */
#define DEFINE_SHIFTED(NAME, T)                                                                \
    TI_CLONES static double NAME(const T* x, int64_t n, double shift) {                        \
        double sums[LANES] = {0};                                                              \
        int64_t i = 0;                                                                         \
        for (; n - i >= LANES; i += LANES) {                                                   \
            for (int j = 0; j < LANES; j++) {                                                  \
                double d = (double)x[i + j] - shift;                                           \
                sums[j] += d * d;                                                              \
            }                                                                                  \
        }                                                                                      \
        double total = 0.0;                                                                    \
        for (int j = 0; j < LANES; j++) total += sums[j];                                      \
        for (; i < n; i++) {                                                                   \
            double d = (double)x[i] - shift;                                                   \
            total += d * d;                                                                    \
        }                                                                                      \
        return total;                                                                          \
    }

DEFINE_SHIFTED(shifted_f32, float)
DEFINE_SHIFTED(shifted_f64, double)

/* ---- the histogram's grid: _host_binning.host_grid, operation for operation ---------------- */

#define DEFINE_GRID(NAME, T, MAX, EPS, ABS)                                                    \
    static void NAME(T low, T high, int32_t bins, double* grid) {                              \
        T narrow_below = (T)(4.0 * (double)bins / (double)(MAX));                              \
        int narrow = (high - low) < narrow_below;                                              \
        T a = ABS(low), b = ABS(high);                                                         \
        T width = (a >= b ? a : b) * (T)(EPS);                                                 \
        T pad = narrow ? (width >= (T)0.5 ? width : (T)0.5) : (T)0;                            \
        T wide_low = low - pad, wide_high = high + pad;                                        \
        if (isinf(wide_high)) {                                                                \
            wide_low = low - (T)2 * pad;                                                       \
            wide_high = high;                                                                  \
        } else if (isinf(wide_low)) {                                                          \
            wide_low = low;                                                                    \
            wide_high = high + (T)2 * pad;                                                     \
        }                                                                                      \
        T half_lo = wide_low * (T)0.5;                                                         \
        T scale = ((T)1 / (wide_high * (T)0.5 - half_lo)) * (T)bins;                           \
        grid[0] = (double)wide_low;                                                            \
        grid[1] = (double)wide_high;                                                           \
        grid[2] = (double)half_lo;                                                             \
        grid[3] = (double)scale;                                                               \
    }

DEFINE_GRID(grid_f32, float, FLT_MAX, FLT_EPSILON, fabsf)
DEFINE_GRID(grid_f64, double, DBL_MAX, DBL_EPSILON, fabs)

/* ---- the bins: trunc((x * 0.5 - half_lo) * scale), the max's bucket ``bins`` apart ---------- */

/* Add the BIN_LANES copies of the table into ``counts`` (zeroing them if ``clear``): lane by
   lane, without a division per entry (a 64-bit ``%`` took a 640-entry tensor's histogram from
   under a microsecond to about five). */
static void bins_fold(uint32_t* lanes, int64_t width, int64_t* counts, int clear) {
    for (int lane = 0; lane < BIN_LANES; lane++) {
        uint32_t* table = lanes + lane * width;
        for (int64_t b = 0; b < width; b++) counts[b] += table[b];
        if (clear) memset(table, 0, sizeof(uint32_t) * (size_t)width);
    }
}

#define DEFINE_BINS(NAME, T)                                                                   \
    TI_CLONES static int NAME(const T* x, int64_t n, T half_lo, T scale, int32_t bins,         \
                              uint32_t* lanes, int64_t* counts) {                              \
        const int64_t width = (int64_t)bins + 1;                                               \
        const T limit = (T)width; /* an offset below it truncates to at most ``bins`` */       \
        int32_t found[BIN_CHUNK];                                                              \
        int64_t since_flush = 0;                                                               \
        for (int64_t start = 0; start < n; start += BIN_CHUNK) {                               \
            int64_t size = n - start < BIN_CHUNK ? n - start : BIN_CHUNK;                      \
            int outside = 0;                                                                   \
            for (int64_t k = 0; k < size; k++) {                                               \
                T offset = (x[start + k] * (T)0.5 - half_lo) * scale;                          \
                int inside = offset >= (T)0 && offset < limit;                                 \
                outside |= !inside;                                                            \
                found[k] = inside ? (int32_t)offset : 0;                                       \
            }                                                                                  \
            if (outside) return STATUS_BIN_OVERFLOW;                                           \
            int64_t k = 0;                                                                     \
            for (; k + BIN_LANES <= size; k += BIN_LANES) {                                    \
                for (int lane = 0; lane < BIN_LANES; lane++)                                   \
                    lanes[lane * width + found[k + lane]]++;                                   \
            }                                                                                  \
            for (; k < size; k++) lanes[found[k]]++;                                           \
            since_flush += size;                                                               \
            if (since_flush >= ((int64_t)1 << 31)) { /* a lane stays below 2**32 */            \
                bins_fold(lanes, width, counts, 1);                                            \
                since_flush = 0;                                                               \
            }                                                                                  \
        }                                                                                      \
        bins_fold(lanes, width, counts, 0);                                                    \
        return STATUS_OK;                                                                      \
    }

DEFINE_BINS(bins_f32, float)
DEFINE_BINS(bins_f64, double)

/* ---- order statistics: a radix selection in the gathered subsample's keys ------------------ */

/* Floats as unsigned keys in their order (a negative float's bits inverted, a positive one's sign
   bit set): selecting among the keys by their digits selects among the floats. */
static uint32_t order_key_f32(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}
static float order_float_f32(uint32_t key) {
    uint32_t bits = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static uint64_t order_key_f64(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits >> 63 ? ~bits : bits | ((uint64_t)1 << 63);
}
static double order_float_f64(uint64_t key) {
    uint64_t bits = key >> 63 ? key & ~((uint64_t)1 << 63) : ~key;
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* The order statistics are found by a radix selection, most significant digit first: a pass
   counts the keys' next digit (below the leading bits they all share), the keys of the digits
   that hold a wanted rank move to scratch memory, a bucket each, and each bucket is split again
   until it is small (then sorted) or of one key (a ReLU's zeros). A level reads its keys three
   times (for the bits they share, to count, to move), and only the wanted buckets go on to the
   next, which takes at least SELECT_BITS bits more: at most KEY_BITS / SELECT_BITS levels split.
   A bucket of SELECT_MANY keys or more has its counts and write cursors in SELECT_LANES copies,
   key i going to copy i % LANES: a run of keys of one digit would otherwise make each count wait
   for the one before it. A smaller one has one copy: clearing and adding eight costs it more. */
#define SELECT_BITS 8
#define SELECT_RADIX (1 << SELECT_BITS)
#define SELECT_LANES 8
#define SELECT_PAD 8    /* a lane's table 2,112 bytes after the one before: none 4 KiB apart */
#define SELECT_SMALL 32 /* a bucket this small is insertion-sorted */
#define SELECT_MANY 2048 /* a bucket this large is counted in SELECT_LANES tables, a smaller in one */

typedef struct {
    int64_t place; /* where its keys start, in the keys and in the scratch */
    int64_t size;  /* its keys */
    int64_t first; /* its first wanted rank, an index into the caller's ranks */
    int64_t count; /* its wanted ranks */
} Bucket;

/* NAME(keys, scratch, m, ranks, count, found, buckets, rebased): found[j] is the key of rank
   ranks[j] (ascending, in [0, m)) among keys[0..m); the keys are reordered, scratch[0..m) is
   overwritten. A level that splits takes, after those of the levels above it, a Bucket per
   wanted digit (at most min(count, SELECT_RADIX)) and ``count`` rebased ranks: buckets and
   rebased have room for KEY_BITS / SELECT_BITS levels of that. */
#define DEFINE_SELECT(NAME, K, KEY_BITS)                                                       \
    /* Count the digit at ``shift`` (``mask`` wide) over keys[0..m), note the buckets of the   \
       digits that hold a wanted rank (their ranks rebased to the bucket) and move their keys  \
       to scratch, bucket after bucket; returns how many buckets. */                           \
    TI_NOINLINE static int64_t NAME##_split(const K* keys, K* scratch, int64_t m, int shift,   \
                                            K mask, const int64_t* ranks, int64_t count,       \
                                            Bucket* buckets, int64_t* rebased) {               \
        int64_t counts[SELECT_LANES][SELECT_RADIX + SELECT_PAD];                               \
        /* few keys: one table (clearing and adding eight cost more than the waits they save) */ \
        const int lanes = m >= SELECT_MANY ? SELECT_LANES : 1;                                 \
        const int64_t lanes_end = lanes == 1 ? 0 : m / SELECT_LANES * SELECT_LANES;            \
        memset(counts, 0, (size_t)lanes * sizeof counts[0]);                                   \
        int64_t i = 0;                                                                         \
        for (; i < lanes_end; i += SELECT_LANES)                                               \
            for (int lane = 0; lane < SELECT_LANES; lane++)                                    \
                counts[lane][(keys[i + lane] >> shift) & mask]++;                              \
        for (; i < m; i++) counts[0][(keys[i] >> shift) & mask]++;                             \
        int64_t found = 0, start = 0, place = 0, r = 0, digit = 0;                             \
        int64_t wanted[SELECT_RADIX];                                                          \
        const int digits = (int)(mask & (SELECT_RADIX - 1)) + 1; /* mask < SELECT_RADIX */    \
        for (int d = 0; d < digits; d++) {                                                     \
            int64_t size = 0;                                                                  \
            for (int lane = 0; lane < lanes; lane++) size += counts[lane][d];                  \
            wanted[d] = r < count && ranks[r] < start + size;                                  \
            if (wanted[d]) {                                                                   \
                Bucket* bucket = &buckets[found++];                                            \
                bucket->place = place;                                                         \
                bucket->size = size;                                                           \
                bucket->first = r;                                                             \
                for (; r < count && ranks[r] < start + size; r++) rebased[r] = ranks[r] - start; \
                bucket->count = r - bucket->first;                                             \
                for (int lane = 0; lane < lanes; lane++) { /* lane's first place */            \
                    int64_t in_lane = counts[lane][d];                                         \
                    counts[lane][d] = place;                                                   \
                    place += in_lane;                                                          \
                }                                                                              \
                digit = d;                                                                     \
            }                                                                                  \
            start += size;                                                                     \
        }                                                                                      \
        if (found == 1) { /* one bucket: a compaction, its cursor in a register */             \
            const K want = (K)digit;                                                           \
            int64_t n = 0;                                                                     \
            for (i = 0; i < m; i++) {                                                          \
                K key = keys[i];                                                               \
                scratch[n] = key;                                                              \
                n += ((key >> shift) & mask) == want;                                          \
            }                                                                                  \
            return found;                                                                      \
        }                                                                                      \
        K unwanted[SELECT_LANES]; /* where the keys of the other digits are written */         \
        for (i = 0; i < lanes_end; i += SELECT_LANES)                                          \
            for (int lane = 0; lane < SELECT_LANES; lane++) {                                  \
                K key = keys[i + lane];                                                        \
                int64_t d = (int64_t)((key >> shift) & mask);                                  \
                K* at = wanted[d] ? scratch + counts[lane][d] : &unwanted[lane];               \
                *at = key;                                                                     \
                counts[lane][d] += wanted[d];                                                  \
            }                                                                                  \
        for (; i < m; i++) {                                                                   \
            K key = keys[i];                                                                   \
            int64_t d = (int64_t)((key >> shift) & mask);                                      \
            if (wanted[d]) scratch[counts[0][d]++] = key;                                      \
        }                                                                                      \
        return found;                                                                          \
    }                                                                                          \
    static void NAME(K* keys, K* scratch, int64_t m, const int64_t* ranks, int64_t count,     \
                     K* found, Bucket* buckets, int64_t* rebased) {                            \
        if (m <= SELECT_SMALL) {                                                               \
            for (int64_t i = 1; i < m; i++) {                                                  \
                K key = keys[i];                                                               \
                int64_t j = i;                                                                 \
                for (; j > 0 && keys[j - 1] > key; j--) keys[j] = keys[j - 1];                 \
                keys[j] = key;                                                                 \
            }                                                                                  \
            for (int64_t j = 0; j < count; j++) found[j] = keys[ranks[j]];                     \
            return;                                                                            \
        }                                                                                      \
        K differ = 0; /* the bits in which some key differs from the first */                  \
        for (int64_t i = 1; i < m; i++) differ |= keys[i] ^ keys[0];                           \
        int bits = 0; /* the digit is taken below the leading bits every key shares */         \
        while (bits < KEY_BITS && (differ >> bits)) bits++;                                    \
        if (bits == 0) { /* one key (a ReLU's zeros) */                                        \
            for (int64_t j = 0; j < count; j++) found[j] = keys[0];                            \
            return;                                                                            \
        }                                                                                      \
        int shift = bits > SELECT_BITS ? bits - SELECT_BITS : 0;                               \
        K mask = (K)((((K)1) << (bits - shift)) - 1);                                          \
        int64_t parts = NAME##_split(keys, scratch, m, shift, mask, ranks, count, buckets,     \
                                     rebased);                                                 \
        for (int64_t b = 0; b < parts; b++) { /* the keys' memory is free: it is the scratch */ \
            const Bucket* bucket = &buckets[b];                                                \
            NAME(scratch + bucket->place, keys + bucket->place, bucket->size,                  \
                 rebased + bucket->first, bucket->count, found + bucket->first,                \
                 buckets + parts, rebased + count);                                            \
        }                                                                                      \
    }

DEFINE_SELECT(select_u32, uint32_t, 32)
DEFINE_SELECT(select_u64, uint64_t, 64)

/* The entries at ``ranks`` (ascending) of the sorted x[index[0..m)] (x[0..m) without index), as
   doubles; -1 where memory runs out. Memory: the keys and as much scratch (8 bytes an entry of
   float32 in all), 36 or 72 bytes a rank and up to 32 or 64 KiB of buckets (float32, float64). */
#define DEFINE_ORDER(NAME, T, K, KEY, FLOAT, SELECT, KEY_BITS)                                 \
    static int NAME(const T* x, const int64_t* index, int64_t m, const int64_t* ranks,         \
                    int64_t count, double* out) {                                              \
        if (m <= 0 || count <= 0) return 0; /* nothing to find (and malloc(0) may be NULL) */  \
        K* keys = (K*)malloc((size_t)m * 2 * sizeof(K));                                       \
        const size_t levels = KEY_BITS / SELECT_BITS; /* that split, at most */               \
        const size_t parts = (size_t)(count < SELECT_RADIX ? count : SELECT_RADIX);           \
        K* found = (K*)malloc((size_t)count * sizeof(K));                                      \
        Bucket* buckets = (Bucket*)malloc(levels * parts * sizeof(Bucket));                    \
        int64_t* rebased = (int64_t*)malloc(levels * (size_t)count * sizeof(int64_t));         \
        int failed = keys == NULL || found == NULL || buckets == NULL || rebased == NULL;      \
        if (!failed) {                                                                         \
            if (index != NULL)                                                                 \
                for (int64_t i = 0; i < m; i++) keys[i] = KEY(x[index[i]]);                    \
            else                                                                               \
                for (int64_t i = 0; i < m; i++) keys[i] = KEY(x[i]);                           \
            SELECT(keys, keys + m, m, ranks, count, found, buckets, rebased);                  \
            for (int64_t j = 0; j < count; j++) out[j] = (double)FLOAT(found[j]);              \
        }                                                                                      \
        free(rebased);                                                                         \
        free(buckets);                                                                         \
        free(found);                                                                           \
        free(keys);                                                                            \
        return failed ? -1 : 0;                                                                \
    }

DEFINE_ORDER(order_f32, float, uint32_t, order_key_f32, order_float_f32, select_u32, 32)
DEFINE_ORDER(order_f64, double, uint64_t, order_key_f64, order_float_f64, select_u64, 64)

/* ---- the edges: the first float of each bin (reducers/_edges.py, found by bisection) -------- */

/* Floats as integer keys in their order (-0.0 and 0.0 share key 0), and back. Not the order
   statistics' keys above: those tell -0.0 from 0.0 and are unsigned for the radix selection, while
   the edges must be the floats numpy's search (``_edges._Floats.keys``) finds, where a zero
   edge is 0.0. */
static int64_t key_f32(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? -(int64_t)(bits & 0x7fffffff) : (int64_t)bits;
}
static float float_f32(int64_t key) {
    uint32_t bits = key < 0 ? (uint32_t)(-key) | 0x80000000u : (uint32_t)key;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static int64_t key_f64(double x) {
    int64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? -(bits & INT64_MAX) : bits;
}
static double float_f64(int64_t key) {
    uint64_t bits = key < 0 ? (uint64_t)(-key) | ((uint64_t)1 << 63) : (uint64_t)key;
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Each inner edge is the smallest key in (key(lo), key(hi)] whose float's offset reaches its bin:
   the bin function is non-decreasing, so a bisection finds it, from a bracket of a few keys
   around the nominal edge when that holds it (nearly always), else from the whole range. */
#define DEFINE_EDGES(NAME, T, KEY, FLOAT, MAX)                                                 \
    static int NAME##_reached(int64_t key, T half_lo, T scale, T target) {                     \
        return (FLOAT(key) * (T)0.5 - half_lo) * scale >= target;                              \
    }                                                                                          \
    static void NAME(T lo, T hi, T scale, int32_t bins, double* out) {                         \
        const T half_lo = lo * (T)0.5;                                                         \
        const int64_t first = KEY(lo), last = KEY(hi);                                         \
        out[0] = (double)lo;                                                                   \
        out[bins] = (double)hi;                                                                \
        int64_t floor_key = first; /* edges do not decrease: each bounds the next */           \
        for (int32_t bin = 1; bin < bins; bin++) {                                             \
            const T target = (T)bin;                                                           \
            int64_t low = floor_key, high = last;                                              \
            double nominal = ((double)bin / (double)scale + (double)half_lo) * 2.0;            \
            /* a nominal edge past the dtype's range would not convert: no guess then */       \
            int representable = nominal >= -(double)(MAX) && nominal <= (double)(MAX);         \
            int64_t guess = representable ? KEY((T)nominal) : low;                             \
            if (guess > low && guess <= high) {                                                \
                int64_t below = guess - 4 > low ? guess - 4 : low;                             \
                int64_t above = guess + 4 < high ? guess + 4 : high;                           \
                if (!NAME##_reached(below, half_lo, scale, target) || below == low) {          \
                    if (NAME##_reached(above, half_lo, scale, target)) {                       \
                        low = below;                                                           \
                        high = above;                                                          \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            if (low != floor_key && NAME##_reached(low, half_lo, scale, target)) {             \
                low = floor_key; /* a bracket that does not hold the edge: the whole range */  \
                high = last;                                                                   \
            }                                                                                  \
            while (low + 1 < high) { /* high - low may overflow an int64 */               \
                int64_t middle = (low >> 1) + (high >> 1) + (low & high & 1);                  \
                if (NAME##_reached(middle, half_lo, scale, target))                            \
                    high = middle;                                                             \
                else                                                                           \
                    low = middle;                                                              \
            }                                                                                  \
            out[bin] = (double)FLOAT(high);                                                    \
            floor_key = high - 1;                                                              \
        }                                                                                      \
    }

DEFINE_EDGES(edges_f32, float, key_f32, float_f32, FLT_MAX)
DEFINE_EDGES(edges_f64, double, key_f64, float_f64, DBL_MAX)

/* ---- CRC-32C of TensorBoard's record framing (run_directory/_crc32c.py), eight bytes a step --- */

static uint32_t crc_tables[8][256];

static void crc_prepare(void) {
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t r = byte;
        for (int bit = 0; bit < 8; bit++) r = r & 1 ? (r >> 1) ^ 0x82F63B78u : r >> 1;
        crc_tables[0][byte] = r;
    }
    for (int k = 1; k < 8; k++)
        for (int byte = 0; byte < 256; byte++)
            crc_tables[k][byte] =
                (crc_tables[k - 1][byte] >> 8) ^ crc_tables[0][crc_tables[k - 1][byte] & 0xFF];
}

static uint32_t crc32c(const unsigned char* data, Py_ssize_t size) {
    uint32_t r = 0xFFFFFFFFu;
    Py_ssize_t i = 0;
    for (; i + 8 <= size; i += 8) {
        uint32_t low = r ^ ((uint32_t)data[i] | (uint32_t)data[i + 1] << 8 |
                            (uint32_t)data[i + 2] << 16 | (uint32_t)data[i + 3] << 24);
        r = crc_tables[7][low & 0xFF] ^ crc_tables[6][(low >> 8) & 0xFF] ^
            crc_tables[5][(low >> 16) & 0xFF] ^ crc_tables[4][low >> 24] ^
            crc_tables[3][data[i + 4]] ^ crc_tables[2][data[i + 5]] ^ crc_tables[1][data[i + 6]] ^
            crc_tables[0][data[i + 7]];
    }
    for (; i < size; i++) r = crc_tables[0][(r ^ data[i]) & 0xFF] ^ (r >> 8);
    return r ^ 0xFFFFFFFFu;
}

/* ---- the quartiles' subsample positions: reducers/_native.py, draw_positions ---------------- */

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ull

/* SplitMix64 of a counter: the ``i``-th output of the stream ``seed`` (Steele, Lea and Flood). */
static uint64_t splitmix64(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * GOLDEN_GAMMA;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ``size`` positions in [0, numel): the top 53 bits of each output as a double in [0, 1), times
   ``numel``, truncated (numpy computes the same with the same operations where there are no
   kernels). Uniform to within numel / 2**53 of each position's share. */
static void positions(uint64_t seed, int64_t numel, int64_t size, int64_t* out) {
    const double n = (double)numel;
    for (int64_t i = 0; i < size; i++) {
        double u = (double)(splitmix64(seed, (uint64_t)i) >> 11) * 0x1p-53;
        int64_t position = (int64_t)(u * n);
        out[i] = position < numel ? position : numel - 1;
    }
}

/* ---- the Python functions ------------------------------------------------------------------ */

static int as_int64(PyObject* value, int64_t* out) {
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

static int as_pointer(PyObject* value, void** out) {
    *out = PyLong_AsVoidPtr(value);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static int check_args(Py_ssize_t nargs, Py_ssize_t expected, const char* name) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* The passes of ``reduce`` into ``out`` and ``counts`` (see there), with the GIL released. */
static int reduce_into(const void* data, int64_t n, int64_t dtype, const void* index, int64_t m,
                       const int64_t* ranks, int64_t count, int64_t bins, uint32_t* lanes,
                       double* out, int64_t* counts, int* failed) {
    int status = STATUS_OK;
    Summary s;
    if (dtype == DTYPE_FLOAT32)
        summary_f32((const float*)data, n, &s);
    else
        summary_f64((const double*)data, n, &s);
    out[0] = s.total;
    out[1] = s.squares;
    out[2] = s.lo;
    out[3] = s.hi;
    out[4] = s.zeros;
    if (!isfinite(s.total) || !isfinite(s.squares)) return STATUS_NONFINITE;
    if (m > 0) {
        double* found = out + 5;
        *failed = dtype == DTYPE_FLOAT32
                      ? order_f32((const float*)data, (const int64_t*)index, m, ranks, count, found)
                      : order_f64((const double*)data, (const int64_t*)index, m, ranks, count,
                                  found);
    }
    if (!*failed && bins > 0) {
        double* grid = out + 5 + count;
        memset(counts, 0, sizeof(int64_t) * (size_t)(bins + 1));
        if (dtype == DTYPE_FLOAT32) {
            grid_f32((float)s.lo, (float)s.hi, (int32_t)bins, grid);
            status = bins_f32((const float*)data, n, (float)grid[2], (float)grid[3], (int32_t)bins,
                              lanes, counts);
        } else {
            grid_f64(s.lo, s.hi, (int32_t)bins, grid);
            status =
                bins_f64((const double*)data, n, grid[2], grid[3], (int32_t)bins, lanes, counts);
        }
    }
    return status;
}

/* reduce(data, n, dtype, index, m, ranks, count, bins, out, counts) -> status
 *
 * out (double): total, squares, lo, hi, zeros, the ``count`` order statistics at ``ranks``
 * (ascending) of the subsample x[index[0..m)] (index 0: the first m entries; m 0: none), then
 * the grid's lo, hi, half_lo and scale; counts (int64, ``bins + 1``, zeroed here): the bins, the
 * max's bucket last. ``bins`` 0: no histogram. A non-finite entry (sums not finite) stops after
 * the sums (status 1); an offset past the last bin stops the binning (status 2).
 */
static PyObject* reduce(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *data, *index, *ranks, *out_pointer, *counts_pointer;
    int64_t n, dtype, m, count, bins;
    if (check_args(nargs, 10, "reduce") || as_pointer(args[0], &data) ||
        as_int64(args[1], &n) || as_int64(args[2], &dtype) || as_pointer(args[3], &index) ||
        as_int64(args[4], &m) || as_pointer(args[5], &ranks) || as_int64(args[6], &count) ||
        as_int64(args[7], &bins) || as_pointer(args[8], &out_pointer) ||
        as_pointer(args[9], &counts_pointer))
        return NULL;
    if (bins < 0 || bins > INT32_MAX - 1 || m < 0 || n < 1 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "reduce: a size is out of range");
        return NULL;
    }
    uint32_t* lanes = NULL;
    if (bins > 0) {
        lanes = (uint32_t*)calloc((size_t)BIN_LANES * (size_t)(bins + 1), sizeof(uint32_t));
        if (lanes == NULL) return PyErr_NoMemory();
    }
    int status, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    status = reduce_into(data, n, dtype, index, m, (const int64_t*)ranks, count, bins, lanes,
                         (double*)out_pointer, (int64_t*)counts_pointer, &failed);
    Py_END_ALLOW_THREADS
    free(lanes);
    if (failed) return PyErr_NoMemory();
    return PyLong_FromLong(status);
}

/* ---- the default profile's values from ``reduce``'s: reducers/_fused.py, in the working dtype */

enum { STATUS_MOMENTS_ON_HOST = 4 };
#define MOMENTS 9

/* From the summary (``numbers``: total, squares, lo, hi, zeros), the order statistics after it
   and the grid after them, the values the reducers give, rounded to T: ``moments``' nine (as
   ``functional.host_moment_values``, its second pass over the ``n`` entries at ``x`` here, with
   ``SHIFTED``), the quantiles (as ``QuantilePlan.interpolate``: a level is its weight and the
   places of its low and high entry among the order statistics) and the packed histogram (as
   ``_host_binning.pack_histogram``). Returns STATUS_MOMENTS_ON_HOST, moments left unwritten,
   where ``host_moment_values`` would scale the squares. */
#define DEFINE_FINISH(NAME, T, MIN_NORMAL, EPS, MAX, SHIFTED)                                  \
    static int NAME(const double* numbers, const T* x, int64_t n, int64_t count,               \
                    const double* levels, int64_t nlevels, int64_t bins, const int64_t* counts, \
                    T* values) {                                                               \
        const double total = numbers[0], squares = numbers[1], lo = numbers[2];                \
        const double hi = numbers[3], zeros = numbers[4], count_n = (double)n;                 \
        int status = STATUS_OK;                                                                \
        double max_abs = fabs(lo) >= fabs(hi) ? fabs(lo) : fabs(hi);                           \
        double low = sqrt((double)(MIN_NORMAL) / (double)(EPS));                               \
        double high = sqrt((double)(MAX) / (4.0 * count_n));                                   \
        double mean = total / count_n;                                                         \
        double m2 = squares - total * mean;                                                    \
        int safe = max_abs == 0.0 || (low <= max_abs && max_abs < high);                       \
        if (safe && !(isfinite(m2) && m2 > 0.0 && mean * mean * count_n <= 4.0 * m2)) {        \
            /* about the mean rounded to T, then corrected for the rounding */                 \
            double shift = (double)(T)mean;                                                    \
            m2 = SHIFTED(x, n, shift) - count_n * ((mean - shift) * (mean - shift));           \
            m2 = m2 > 0.0 ? m2 : 0.0;                                                          \
        }                                                                                      \
        if (!safe || !isfinite(m2)) {                                                          \
            status = STATUS_MOMENTS_ON_HOST;                                                   \
        } else {                                                                               \
            double variance = m2 / count_n;                                                    \
            values[0] = (T)mean;                                                               \
            values[1] = (T)sqrt(variance);                                                     \
            values[2] = (T)lo;                                                                 \
            values[3] = (T)hi;                                                                 \
            values[4] = (T)(zeros / count_n);                                                  \
            values[5] = (T)0;                                                                  \
            values[6] = (T)sqrt(variance + mean * mean);                                       \
            values[7] = (T)max_abs;                                                            \
            values[8] = (T)sqrt(squares);                                                      \
        }                                                                                      \
        const double* ordered = numbers + 5;                                                   \
        T* quantiles = values + MOMENTS;                                                       \
        for (int64_t level = 0; level < nlevels; level++) {                                    \
            T gamma = (T)levels[3 * level];                                                    \
            T below = (T)ordered[(int64_t)levels[3 * level + 1]];                              \
            T above = (T)ordered[(int64_t)levels[3 * level + 2]];                              \
            T span = above - below;                                                            \
            if (!isfinite(span)) { /* halves, as numpy's lerp where the span overflows */      \
                T half_below = below * (T)0.5, half_above = above * (T)0.5;                    \
                T half = half_below + (half_above - half_below) * gamma;                       \
                half = half_below > half ? half_below : half;                                  \
                half = half_above < half ? half_above : half;                                  \
                quantiles[level] = half * (T)2;                                                \
            } else if (gamma >= (T)0.5) {                                                      \
                quantiles[level] = above - span * ((T)1 - gamma);                              \
            } else {                                                                           \
                quantiles[level] = below + span * gamma;                                       \
            }                                                                                  \
        }                                                                                      \
        if (bins > 0) {                                                                        \
            const double* grid = numbers + 5 + count;                                          \
            T* packed = quantiles + nlevels;                                                   \
            packed[0] = (T)grid[0];                                                            \
            packed[1] = (T)grid[1];                                                            \
            packed[2] = (T)grid[3];                                                            \
            for (int64_t b = 0; b + 1 < bins; b++) packed[3 + b] = (T)counts[b];               \
            packed[2 + bins] = (T)(counts[bins - 1] + counts[bins]);                           \
            packed[3 + bins] = (T)0;                                                           \
        }                                                                                      \
        return status;                                                                         \
    }

DEFINE_FINISH(finish_f32, float, FLT_MIN, FLT_EPSILON, FLT_MAX, shifted_f32)
DEFINE_FINISH(finish_f64, double, DBL_MIN, DBL_EPSILON, DBL_MAX, shifted_f64)

enum { STATUS_NO_MEMORY = 8 };

/* The edges of the packed histogram at ``packed`` (``bins + 4`` values of the working dtype:
   lo, hi, scale, the counts, the non-finite count), written after it: ``bins + 1`` values of the
   same dtype, each a float of it (``edges_*``), all NaN where the grid is not finite. ``found``
   holds ``bins + 1`` doubles. */
#define DEFINE_PACKED_EDGES(NAME, T, EDGES)                                                    \
    static void NAME(T* packed, int64_t bins, double* found) {                                 \
        T* out = packed + bins + 4;                                                            \
        if (!isfinite(packed[0]) || !isfinite(packed[1])) {                                    \
            for (int64_t i = 0; i <= bins; i++) out[i] = (T)NAN;                               \
            return;                                                                            \
        }                                                                                      \
        EDGES(packed[0], packed[1], packed[2], (int32_t)bins, found);                          \
        for (int64_t i = 0; i <= bins; i++) out[i] = (T)found[i];                              \
    }

DEFINE_PACKED_EDGES(packed_edges_f32, float, edges_f32)
DEFINE_PACKED_EDGES(packed_edges_f64, double, edges_f64)

/* What ``profile`` computes, without the GIL: ``reduce_into``, then ``finish_*`` when it wrote
   everything, then the histogram's edges (``packed_edges_*``), so that the thread that reads
   the values back has none to search. STATUS_NO_MEMORY where a table could not be allocated
   (nothing usable written). */
static int profile_run(const void* data, int64_t n, int64_t dtype, const void* index, int64_t m,
                       const int64_t* ranks, int64_t count, const double* levels,
                       int64_t nlevels, int64_t bins, double* numbers, void* values) {
    uint32_t* lanes = NULL;
    int64_t* counts = NULL;
    if (bins > 0) {
        lanes = (uint32_t*)calloc((size_t)BIN_LANES * (size_t)(bins + 1), sizeof(uint32_t));
        counts = (int64_t*)malloc(sizeof(int64_t) * (size_t)(bins + 1));
    }
    int status = STATUS_OK, failed = bins > 0 && (lanes == NULL || counts == NULL);
    if (!failed) {
        status = reduce_into(data, n, dtype, index, m, ranks, count, bins, lanes, numbers, counts,
                             &failed);
        if (!failed && status == STATUS_OK)
            status = dtype == DTYPE_FLOAT32
                         ? finish_f32(numbers, (const float*)data, n, count, levels, nlevels, bins,
                                      counts, (float*)values)
                         : finish_f64(numbers, (const double*)data, n, count, levels, nlevels,
                                      bins, counts, (double*)values);
        if (!failed && bins > 0 && (status == STATUS_OK || status == STATUS_MOMENTS_ON_HOST)) {
            /* the counts are packed: their buffer, bins + 1 eight-byte slots, holds the edges */
            double* found = (double*)(void*)counts;
            if (dtype == DTYPE_FLOAT32)
                packed_edges_f32((float*)values + MOMENTS + nlevels, bins, found);
            else
                packed_edges_f64((double*)values + MOMENTS + nlevels, bins, found);
        }
    }
    free(counts);
    free(lanes);
    return failed ? STATUS_NO_MEMORY : status;
}

/* A writable (or readable) contiguous buffer of at least ``bytes`` bytes, or an error. */
static int get_buffer(PyObject* object, Py_buffer* view, Py_ssize_t bytes, int writable,
                      const char* what) {
    if (PyObject_GetBuffer(object, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) return -1;
    if (view->len < bytes) {
        PyErr_Format(PyExc_ValueError, "profile: %s holds %zd bytes, not %zd", what, view->len,
                     bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Whether ``ranks`` (int64) and ``levels`` (float64, three a level) describe quantiles of a
   subsample of ``m`` entries: whole items, ranks ascending in [0, m), each level's two places
   whole numbers within the ranks, and, without an index, a subsample within the ``n`` entries.
   Anything else would make the passes read outside their buffers: a ValueError instead. */
static int valid_plan(const Py_buffer* ranks, const Py_buffer* levels, int64_t m, int64_t n,
                      int indexed) {
    if (m == 0) return 1;
    const char* problem = NULL;
    int64_t count = (int64_t)(ranks->len / (Py_ssize_t)sizeof(int64_t));
    int64_t nlevels = (int64_t)(levels->len / (Py_ssize_t)(3 * sizeof(double)));
    const int64_t* r = (const int64_t*)ranks->buf;
    const double* l = (const double*)levels->buf;
    if (ranks->len % (Py_ssize_t)sizeof(int64_t) || levels->len % (Py_ssize_t)(3 * sizeof(double)))
        problem = "ranks or levels hold a partial item";
    else if (!indexed && m > n)
        problem = "the subsample is larger than the tensor";
    for (int64_t i = 0; problem == NULL && i < count; i++)
        if (r[i] < 0 || r[i] >= m || (i > 0 && r[i] < r[i - 1]))
            problem = "the ranks are not ascending within the subsample";
    for (int64_t i = 0; problem == NULL && i < nlevels; i++) {
        for (int k = 1; k < 3; k++) {
            double at = l[3 * i + k];
            if (!(at >= 0.0 && at < (double)count && at == floor(at)))
                problem = "a level's place is not one of the ranks";
        }
    }
    if (problem == NULL) return 1;
    PyErr_Format(PyExc_ValueError, "profile: %s", problem);
    return 0;
}

/* ``profile``'s arguments, read and checked; ``views`` hold its four buffers until
   ``release_views``. */
typedef struct {
    void* data;
    int64_t n, dtype;
    void* index;
    int64_t m, count, nlevels, bins;
    Py_buffer views[4]; /* ranks, levels, numbers, values */
} ProfileArgs;

static void release_views(ProfileArgs* a, int held) {
    for (int i = held - 1; i >= 0; i--) PyBuffer_Release(&a->views[i]);
}

/* Reads ``profile``'s ten arguments into ``a`` (views held on success). ``indexed``: the
   subsample's positions come from elsewhere than ``index`` (a seed), so they may exceed the
   first ``n``; ``status_slot``: ``numbers`` holds one more float64, the status's. */
static int profile_args(PyObject* const* args, const char* name, int indexed, int status_slot,
                        ProfileArgs* a) {
    if (as_pointer(args[0], &a->data) || as_int64(args[1], &a->n) ||
        as_int64(args[2], &a->dtype) || as_pointer(args[3], &a->index) ||
        as_int64(args[4], &a->m) || as_int64(args[7], &a->bins))
        return -1;
    if (a->bins < 0 || a->bins > INT32_MAX - 1 || a->m < 0 || a->m > INT64_MAX / 16 || a->n < 1 ||
        (a->dtype != DTYPE_FLOAT32 && a->dtype != DTYPE_FLOAT64)) {
        PyErr_Format(PyExc_ValueError, "%s: a size is out of range", name);
        return -1;
    }
    Py_buffer* ranks = &a->views[0];
    Py_buffer* levels = &a->views[1];
    if (get_buffer(args[5], ranks, 0, 0, "ranks")) return -1;
    if (get_buffer(args[6], levels, 0, 0, "levels")) {
        release_views(a, 1);
        return -1;
    }
    a->count = a->m > 0 ? (int64_t)(ranks->len / (Py_ssize_t)sizeof(int64_t)) : 0;
    a->nlevels = a->m > 0 ? (int64_t)(levels->len / (Py_ssize_t)(3 * sizeof(double))) : 0;
    if (!valid_plan(ranks, levels, a->m, a->n, indexed || a->index != NULL)) {
        release_views(a, 2);
        return -1;
    }
    if (a->count == 0) a->m = 0; /* no rank wanted: no order statistics, no quantiles */
    if (a->m == 0) a->nlevels = 0;
    Py_ssize_t itemsize = a->dtype == DTYPE_FLOAT32 ? sizeof(float) : sizeof(double);
    Py_ssize_t needed =
        (Py_ssize_t)(MOMENTS + a->nlevels + (a->bins > 0 ? 2 * a->bins + 5 : 0)) * itemsize;
    Py_ssize_t numbers = (Py_ssize_t)(5 + a->count + 4 + status_slot) * (Py_ssize_t)sizeof(double);
    if (get_buffer(args[8], &a->views[2], numbers, 1, "numbers")) {
        release_views(a, 2);
        return -1;
    }
    if (get_buffer(args[9], &a->views[3], needed, 1, "values")) {
        release_views(a, 3);
        return -1;
    }
    return 0;
}

/* profile(data, n, dtype, index, m, ranks, levels, bins, numbers, values) -> status
 *
 * ``reduce``, then the values of the default profile (``finish_*``): ``ranks`` (int64) and
 * ``levels`` (float64, three per level) are buffers whose sizes give the counts; ``numbers``
 * (float64) receives what ``reduce`` puts in its ``out``, ``values`` (the working dtype) the nine
 * moments, the quantiles and, with ``bins``, the packed histogram and its ``bins + 1`` edges
 * (``packed_edges_*``). Status as ``reduce``'s, or
 * STATUS_MOMENTS_ON_HOST (the rest written); one call, with the GIL released once.
 */
static PyObject* profile(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    ProfileArgs a;
    if (check_args(nargs, 10, "profile") || profile_args(args, "profile", 0, 0, &a)) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = profile_run(a.data, a.n, a.dtype, a.index, a.m, (const int64_t*)a.views[0].buf,
                         a.count, (const double*)a.views[1].buf, a.nlevels, a.bins,
                         (double*)a.views[2].buf, a.views[3].buf);
    Py_END_ALLOW_THREADS
    release_views(&a, 4);
    if (status == STATUS_NO_MEMORY) return PyErr_NoMemory();
    return PyLong_FromLong(status);
}

/* histogram(data, n, dtype, lo, hi, bins, grid, counts) -> status: the grid over [lo, hi] (four
 * doubles into ``grid``) and the bins of every entry (``bins + 1`` int64 into ``counts``). */
static PyObject* histogram(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *data, *grid_pointer, *counts_pointer;
    int64_t n, dtype, bins;
    if (check_args(nargs, 8, "histogram") || as_pointer(args[0], &data) ||
        as_int64(args[1], &n) || as_int64(args[2], &dtype) || as_int64(args[5], &bins) ||
        as_pointer(args[6], &grid_pointer) || as_pointer(args[7], &counts_pointer))
        return NULL;
    double lo = PyFloat_AsDouble(args[3]), hi = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (bins < 1 || bins > INT32_MAX - 1) {
        PyErr_Format(PyExc_ValueError, "bins must be a positive int32, got %lld", (long long)bins);
        return NULL;
    }
    double* grid = (double*)grid_pointer;
    int64_t* counts = (int64_t*)counts_pointer;
    uint32_t* lanes = (uint32_t*)calloc((size_t)BIN_LANES * (size_t)(bins + 1), sizeof(uint32_t));
    if (lanes == NULL) return PyErr_NoMemory();
    int status;
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, sizeof(int64_t) * (size_t)(bins + 1));
    if (dtype == DTYPE_FLOAT32) {
        grid_f32((float)lo, (float)hi, (int32_t)bins, grid);
        status = bins_f32((const float*)data, n, (float)grid[2], (float)grid[3], (int32_t)bins,
                          lanes, counts);
    } else {
        grid_f64(lo, hi, (int32_t)bins, grid);
        status = bins_f64((const double*)data, n, grid[2], grid[3], (int32_t)bins, lanes, counts);
    }
    Py_END_ALLOW_THREADS
    free(lanes);
    return PyLong_FromLong(status);
}

/* order_statistics(data, dtype, index, m, ranks, count, out): the entries at ``ranks``
 * (ascending) of the sorted x[index[0..m)] (index 0: x[0..m)) into ``out`` (doubles). */
static PyObject* order_statistics(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *data, *index, *ranks, *out;
    int64_t dtype, m, count;
    if (check_args(nargs, 7, "order_statistics") || as_pointer(args[0], &data) ||
        as_int64(args[1], &dtype) || as_pointer(args[2], &index) || as_int64(args[3], &m) ||
        as_pointer(args[4], &ranks) || as_int64(args[5], &count) || as_pointer(args[6], &out))
        return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = dtype == DTYPE_FLOAT32 ? order_f32((const float*)data, (const int64_t*)index, m,
                                                (const int64_t*)ranks, count, (double*)out)
                                    : order_f64((const double*)data, (const int64_t*)index, m,
                                                (const int64_t*)ranks, count, (double*)out);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* edges(dtype, lo, hi, scale, bins, out): the ``bins + 1`` edges of the grid (doubles). */
static PyObject* edges(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void* out;
    int64_t dtype, bins;
    if (check_args(nargs, 6, "edges") || as_int64(args[0], &dtype) || as_int64(args[4], &bins) ||
        as_pointer(args[5], &out))
        return NULL;
    double lo = PyFloat_AsDouble(args[1]), hi = PyFloat_AsDouble(args[2]);
    double scale = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (dtype == DTYPE_FLOAT32)
        edges_f32((float)lo, (float)hi, (float)scale, (int32_t)bins, (double*)out);
    else
        edges_f64(lo, hi, scale, (int32_t)bins, (double*)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* draw(seed, numel, size, out): ``positions`` into ``out`` (int64, ``size`` of them). */
static PyObject* draw(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void* out;
    int64_t numel, size;
    if (check_args(nargs, 4, "draw") || as_int64(args[1], &numel) || as_int64(args[2], &size) ||
        as_pointer(args[3], &out))
        return NULL;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[0]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (numel < 1 || size < 0) {
        PyErr_SetString(PyExc_ValueError, "draw: a size is out of range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    positions((uint64_t)seed, numel, size, (int64_t*)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- the reduction queue: ``profile`` on a thread of its own, which never takes the GIL -------
 *
 * On the CPU a sampled tensor's hook copies it (or keeps a gradient as it is) and queues its
 * ``profile`` here; a native thread runs the jobs in order while the model computes, and the
 * caller reads each job's values once ``queue_finished`` (or ``queue_wait``) says it has run. A
 * caller that waits runs the jobs the thread has not started yet itself (``queue_wait``).
 * The thread runs no Python, so the training thread never waits for the GIL on its account.
 * The caller (``_native_worker.py``) keeps every buffer a job reads or writes alive until then:
 * a job holds their addresses only. POSIX threads; elsewhere (Windows) the module has no queue.
 * A queue belongs to the process that made it: in a child made by ``fork``, which has no thread,
 * every call raises, and the child reduces in its hooks.
 *
 * Waking a sleeping thread costs the caller a futex wake, and on a virtual machine the interrupt
 * that reaches the other processor: a submit took a median 11.4 us in the hooks of an MNIST-sized
 * MLP's sampled steps, 1.4 us where the thread needed no wake. A small sample's jobs come a
 * hundred or so microseconds apart, so after each job the thread lingers: for ``linger_ns``
 * (QUEUE_LINGER_NS by default) it looks for the next job every QUEUE_POLL_NS, asleep in between
 * (a timed sleep, no spinning: about 120 us of its processor's time for a whole linger on a
 * virtual machine), and only then waits on the condition. A job submitted while it lingers wakes
 * nothing, and waits for the thread's nap to end (up to QUEUE_POLL_NS and the timer slack, about
 * 100 us, while the model computes); the first job of a sample, and any after a pause, still
 * signal, once each: the submit that wakes the thread marks it awake. */
#ifndef _WIN32
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#define TI_QUEUE 1
#define QUEUE_LINGER_NS 500000 /* 0.5 ms: several times the gap between a small sample's hooks */
#define QUEUE_LINGER_MAX_NS 60000000000LL /* a minute: queue_new refuses more */
#define QUEUE_POLL_NS 50000    /* 50 us asleep (and the system's timer slack, 50 us on Linux) */
#define QUEUE_THREAD_NAME "ti-kernel-queue" /* the thread's name on Linux (15 characters) */

typedef struct Job {
    struct Job* next;
    const void* data;
    int64_t n, dtype, m, count, nlevels, bins;
    const void* index;
    int drawn; /* the positions are drawn from ``seed`` into a table of the job's own */
    uint64_t seed;
    const int64_t* ranks;
    const double* levels;
    double* numbers; /* the status goes after what ``profile`` writes: numbers[5 + count + 4] */
    void* values;
    int64_t ticket; /* its place in the order submitted, from 1 */
    int done;       /* it has run; it is counted (``finished``) once every job before it has */
    int copy;       /* a copy (queue_copy): ``n`` bytes from ``data`` to ``values``, no status */
    int reserved;   /* its submitter runs it (no thread could take it): never claimed */
} Job;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work; /* the thread waits here for jobs */
    pthread_cond_t done; /* callers wait here for finished jobs */
    Job *head, *tail;    /* every job not yet counted, in the order submitted */
    Job* next;           /* the first job no one has started: the thread's, or a waiter's;
                            never a reserved one */
    int64_t submitted, finished;
    int waiters, closing, started, joining;
    int sleeping;      /* the thread waits on ``work``: a submit must signal it */
    int64_t linger_ns; /* how long the thread looks for a next job before it sleeps */
    int64_t wakes;     /* the submits that signalled the thread */
    int64_t helped;    /* the jobs a waiter ran (queue_wait) */
    pthread_t thread;
    pid_t pid;
} Queue;

static const char QUEUE_NAME[] = "torchinstruments.reduction_queue";

static void job_run(Job* job) {
    if (job->copy) {
        memcpy(job->values, job->data, (size_t)job->n);
        return;
    }
    int64_t* drawn = NULL;
    const void* index = job->index;
    int status;
    if (job->drawn && job->m > 0) {
        drawn = (int64_t*)malloc(sizeof(int64_t) * (size_t)job->m);
        if (drawn != NULL) positions(job->seed, job->n, job->m, drawn);
        index = drawn;
    }
    if (job->drawn && job->m > 0 && drawn == NULL)
        status = STATUS_NO_MEMORY;
    else
        status = profile_run(job->data, job->n, job->dtype, index, job->m, job->ranks, job->count,
                             job->levels, job->nlevels, job->bins, job->numbers, job->values);
    free(drawn);
    job->numbers[5 + job->count + 4] = (double)status;
}

/* Waits (lock held) until the first ``ticket`` jobs have run. */
static void wait_finished(Queue* q, int64_t ticket) {
    q->waiters++;
    while (q->finished < ticket) pthread_cond_wait(&q->done, &q->lock);
    q->waiters--;
}

/* The first job from ``job`` on that is not reserved (NULL: none). */
static Job* claimable(Job* job) {
    while (job != NULL && job->reserved) job = job->next;
    return job;
}

/* Takes the first job no one has started (lock held; NULL: none). */
static Job* claim(Queue* q) {
    Job* job = q->next;
    if (job != NULL) q->next = claimable(job->next);
    return job;
}

/* Runs a claimed ``job`` with the lock released (held on entry and on return), then counts the
   jobs at the head that have run: ``finished`` counts jobs in the order submitted, whichever
   thread ran them, so that a ticket at or below it has run with every job before it. */
static void run_claimed(Queue* q, Job* job) {
    pthread_mutex_unlock(&q->lock);
    job_run(job);
    pthread_mutex_lock(&q->lock);
    job->done = 1;
    int counted = 0;
    while (q->head != NULL && q->head->done) {
        Job* first = q->head;
        q->head = first->next;
        if (q->head == NULL) q->tail = NULL;
        q->finished = first->ticket;
        free(first);
        counted = 1;
    }
    if (counted && q->waiters) pthread_cond_broadcast(&q->done);
}

static int64_t monotonic_ns(void) {
    struct timespec now = {0, 0};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Looks for a next job every QUEUE_POLL_NS for ``linger_ns``, the lock released while asleep
   (lock held on entry and on return). */
static void linger(Queue* q) {
    if (q->linger_ns <= 0) return;
    const struct timespec nap = {0, QUEUE_POLL_NS};
    const int64_t until = monotonic_ns() + q->linger_ns;
    while (q->next == NULL && !q->closing && monotonic_ns() < until) {
        pthread_mutex_unlock(&q->lock);
        nanosleep(&nap, NULL);
        pthread_mutex_lock(&q->lock);
    }
}

static void* queue_main(void* argument) {
    Queue* q = (Queue*)argument;
#ifdef __linux__
    /* its own name in top -H, ps -L and /proc (15 characters at most), not the process's */
    pthread_setname_np(pthread_self(), QUEUE_THREAD_NAME);
#endif
    pthread_mutex_lock(&q->lock);
    for (;;) {
        linger(q);
        while (q->next == NULL && !q->closing) {
            q->sleeping = 1;
            pthread_cond_wait(&q->work, &q->lock);
            q->sleeping = 0;
        }
        Job* job = claim(q);
        if (job == NULL) break; /* closing, and every job has started */
        run_claimed(q, job);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* Stops the thread, and returns once every job submitted before has run (GIL held or not: the
   thread never takes it). A second caller meanwhile waits for the first one's join. The jobs a
   waiter claimed (queue_wait) or a submitter runs itself can outlast the thread: they are
   waited for too, so that nothing reads or writes a job's buffers once the queue is closed. */
static void queue_stop(Queue* q) {
    pthread_mutex_lock(&q->lock);
    q->closing = 1;
    pthread_cond_signal(&q->work);
    const int64_t submitted = q->submitted;
    int join = q->started && !q->joining;
    if (join) {
        q->joining = 1;
    } else {
        q->waiters++;
        while (q->joining) pthread_cond_wait(&q->done, &q->lock);
        q->waiters--;
    }
    pthread_mutex_unlock(&q->lock);
    if (join) {
        pthread_join(q->thread, NULL);
        pthread_mutex_lock(&q->lock);
        q->started = 0;
        q->joining = 0;
        pthread_cond_broadcast(&q->done);
        pthread_mutex_unlock(&q->lock);
    }
    pthread_mutex_lock(&q->lock);
    wait_finished(q, submitted);
    pthread_mutex_unlock(&q->lock);
}

static void queue_destroy(PyObject* capsule) {
    Queue* q = (Queue*)PyCapsule_GetPointer(capsule, QUEUE_NAME);
    if (q == NULL || q->pid != getpid()) return; /* a child made by fork: its copy is left as is */
    queue_stop(q);
    pthread_cond_destroy(&q->done);
    pthread_cond_destroy(&q->work);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

/* The queue in ``capsule``, or NULL with an error (not a queue, or another process's). */
static Queue* queue_of(PyObject* capsule) {
    Queue* q = (Queue*)PyCapsule_GetPointer(capsule, QUEUE_NAME);
    if (q != NULL && q->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "the reduction queue belongs to another process");
        return NULL;
    }
    return q;
}

/* queue_new([linger_ns]) -> queue: an empty queue; its thread starts with the first job.
   ``linger_ns``: how long the thread looks for a next job before it sleeps (QUEUE_LINGER_NS;
   0: it sleeps at once, and every job wakes it). */
static PyObject* queue_new(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    int64_t linger_ns = QUEUE_LINGER_NS;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "queue_new takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 1 && as_int64(args[0], &linger_ns)) return NULL;
    if (linger_ns < 0 || linger_ns > QUEUE_LINGER_MAX_NS) {
        PyErr_Format(PyExc_ValueError, "linger_ns must be between 0 and %lld (a minute), not %lld",
                     (long long)QUEUE_LINGER_MAX_NS, (long long)linger_ns);
        return NULL;
    }
    Queue* q = (Queue*)calloc(1, sizeof(Queue));
    if (q == NULL) return PyErr_NoMemory();
    /* initializers fail only for want of memory or of a system resource */
    int made = 0;
    if (pthread_mutex_init(&q->lock, NULL) == 0) made = 1;
    if (made == 1 && pthread_cond_init(&q->work, NULL) == 0) made = 2;
    if (made == 2 && pthread_cond_init(&q->done, NULL) == 0) made = 3;
    if (made < 3) {
        if (made >= 2) pthread_cond_destroy(&q->work);
        if (made >= 1) pthread_mutex_destroy(&q->lock);
        free(q);
        return PyErr_NoMemory();
    }
    q->pid = getpid();
    q->linger_ns = linger_ns;
    PyObject* capsule = PyCapsule_New(q, QUEUE_NAME, queue_destroy);
    if (capsule == NULL) {
        pthread_cond_destroy(&q->done);
        pthread_cond_destroy(&q->work);
        pthread_mutex_destroy(&q->lock);
        free(q);
    }
    return capsule;
}

/* Starts the thread with the asynchronous signals blocked (they go to Python's threads; a fault
   of its own still reaches the handlers, faulthandler's included); lock held. */
static int queue_start(Queue* q) {
    sigset_t all, previous;
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGABRT);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    int failed = pthread_create(&q->thread, NULL, queue_main, q);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    q->started = !failed;
    return failed;
}

static int64_t enqueue(Queue* q, Job* job);

/* queue_submit(queue, seed, data, n, dtype, index, m, ranks, levels, bins, numbers, values)
 *     -> ticket
 *
 * Queues ``profile``'s work on the last ten arguments (see there); ``seed`` (an int, or None)
 * draws the ``m`` positions of the subsample as ``draw`` does, in place of ``index`` (then 0).
 * ``numbers`` holds one float64 more than ``profile``'s, after the grid, where the job writes
 * its status (STATUS_NO_MEMORY: nothing usable). The ticket counts the jobs submitted, this one
 * included; on a closed queue, or where no thread can start, the job runs here, after those
 * before it and before returning.
 */
static PyObject* queue_submit(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    if (check_args(nargs, 12, "queue_submit")) return NULL;
    Queue* q = queue_of(args[0]);
    if (q == NULL) return NULL;
    int drawn = args[1] != Py_None;
    unsigned long long seed = 0;
    if (drawn) {
        seed = PyLong_AsUnsignedLongLong(args[1]);
        if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    ProfileArgs a;
    if (profile_args(args + 2, "queue_submit", drawn, 1, &a)) return NULL;
    if (drawn && a.index != NULL) {
        release_views(&a, 4);
        PyErr_SetString(PyExc_ValueError, "queue_submit: a seed and an index");
        return NULL;
    }
    Job* job = (Job*)malloc(sizeof(Job));
    if (job == NULL) {
        release_views(&a, 4);
        return PyErr_NoMemory();
    }
    *job = (Job){NULL, a.data, a.n, a.dtype, a.m, a.count, a.nlevels, a.bins, a.index, drawn,
                 (uint64_t)seed, (const int64_t*)a.views[0].buf, (const double*)a.views[1].buf,
                 (double*)a.views[2].buf, a.views[3].buf, 0, 0, 0, 0};
    release_views(&a, 4); /* the caller keeps the buffers alive until the job has run */
    return PyLong_FromLongLong(enqueue(q, job));
}

/* Queues ``job`` and returns its ticket; on a closed queue, or where no thread can start, runs
   it here, after the jobs before it, before returning (GIL held on entry and on return).

   Such a job is listed all the same, reserved to its submitter, so that it is counted in its
   turn: another submitter may start the thread meanwhile, whose jobs must not be counted
   before this one has run (``finished`` counts in the order submitted). */
static int64_t enqueue(Queue* q, Job* job) {
    pthread_mutex_lock(&q->lock);
    /* read here, not from the job once the lock is let go: the thread may have freed it */
    const int reserved = job->reserved = q->closing || !(q->started || queue_start(q) == 0);
    const int64_t ticket = job->ticket = ++q->submitted;
    if (q->tail == NULL)
        q->head = job;
    else
        q->tail->next = job;
    q->tail = job;
    if (!reserved) {
        if (q->next == NULL) q->next = job;
        if (q->sleeping) { /* a thread that lingers finds the job by itself */
            q->sleeping = 0; /* one wake per sleep: a second job before it runs signals nothing */
            pthread_cond_signal(&q->work);
            q->wakes++;
        }
    }
    pthread_mutex_unlock(&q->lock);
    if (reserved) { /* closed, or no thread: run it now, in its turn */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&q->lock);
        wait_finished(q, ticket - 1);
        run_claimed(q, job);
        pthread_mutex_unlock(&q->lock);
        Py_END_ALLOW_THREADS
    }
    return ticket;
}

/* queue_copy(queue, source, destination, nbytes) -> ticket
 *
 * Queues a copy of ``nbytes`` bytes from the address ``source`` to ``destination`` (which do
 * not overlap), in its turn among the profile jobs, with the tickets they have: a recorded
 * optimizer step's parameter copies, made by the queue's thread and the training thread at
 * once (``queue_wait``). The caller keeps both alive and unchanged until the job has run. */
static PyObject* queue_copy(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *source, *destination;
    int64_t nbytes;
    if (check_args(nargs, 4, "queue_copy") || as_pointer(args[1], &source) ||
        as_pointer(args[2], &destination) || as_int64(args[3], &nbytes))
        return NULL;
    Queue* q = queue_of(args[0]);
    if (q == NULL) return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "queue_copy: a negative size");
        return NULL;
    }
    Job* job = (Job*)calloc(1, sizeof(Job));
    if (job == NULL) return PyErr_NoMemory();
    job->copy = 1;
    job->data = source;
    job->values = destination;
    job->n = nbytes;
    return PyLong_FromLongLong(enqueue(q, job));
}

enum { COUNT_FINISHED, COUNT_WAKES, COUNT_HELPED };

/* One of the queue's counts, read under its lock. */
static PyObject* queue_count(PyObject* const* args, Py_ssize_t nargs, const char* name, int which) {
    if (check_args(nargs, 1, name)) return NULL;
    Queue* q = queue_of(args[0]);
    if (q == NULL) return NULL;
    pthread_mutex_lock(&q->lock);
    int64_t count = which == COUNT_FINISHED ? q->finished
                    : which == COUNT_WAKES  ? q->wakes
                                            : q->helped;
    pthread_mutex_unlock(&q->lock);
    return PyLong_FromLongLong(count);
}

/* queue_finished(queue) -> int: how many jobs have run, counted in the order submitted: the jobs
   up to that ticket have all run (a waiter may run later ones first, see queue_wait). */
static PyObject* queue_finished(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    return queue_count(args, nargs, "queue_finished", COUNT_FINISHED);
}

/* queue_wakes(queue) -> int: how many submits had to wake the queue's sleeping thread. */
static PyObject* queue_wakes(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    return queue_count(args, nargs, "queue_wakes", COUNT_WAKES);
}

/* queue_helped(queue) -> int: how many jobs callers of ``queue_wait`` ran themselves. */
static PyObject* queue_helped(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    return queue_count(args, nargs, "queue_helped", COUNT_HELPED);
}

/* queue_wait(queue, ticket[, run]): return, with the GIL released meanwhile, once job ``ticket``
 * and every job before it have run.
 *
 * The caller does not sit idle meanwhile: it runs the jobs up to ``ticket`` that the queue's
 * thread has not started, taking each as that thread would take it next, and waits only for
 * those the thread is running. A caller that waits is the training thread at a sample's or a
 * step record's close, with the jobs handed over last still queued: two processors finish them
 * in about half the time one takes. ``run`` 0: the caller runs none, it only waits (what a
 * benchmark compares against). */
static PyObject* queue_wait(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    int64_t ticket, run = 1;
    if (nargs != 2 && check_args(nargs, 3, "queue_wait")) return NULL;
    if (as_int64(args[1], &ticket) || (nargs == 3 && as_int64(args[2], &run))) return NULL;
    Queue* q = queue_of(args[0]);
    if (q == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    if (ticket > q->submitted) ticket = q->submitted;
    while (run && q->finished < ticket && q->next != NULL && q->next->ticket <= ticket) {
        q->helped++;
        run_claimed(q, claim(q));
    }
    wait_finished(q, ticket);
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* queue_close(queue): run what is queued, then stop the thread; return once every job submitted
   before has run, those a waiter or a submitter runs included. Later jobs run in the caller. */
static PyObject* queue_close(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    if (check_args(nargs, 1, "queue_close")) return NULL;
    Queue* q = queue_of(args[0]);
    if (q == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    queue_stop(q);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
#endif

/* ratio_sum(gradient, second, n, dtype, correction, floor) -> float
 *
 * The sum over the ``n`` entries of gradient^2 / max(second / correction, floor) (both arrays of
 * ``dtype``, dense, of ``n`` entries; correction > 0, floor >= 0), in double, GIL released:
 * Adam's gradient-to-second-moment ratio squared, times ``n`` (``_step_math.adam_ratio``).
 */
static PyObject* ratio_sum(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *gradient, *second;
    int64_t n, dtype;
    if (check_args(nargs, 6, "ratio_sum") || as_pointer(args[0], &gradient) ||
        as_pointer(args[1], &second) || as_int64(args[2], &n) || as_int64(args[3], &dtype))
        return NULL;
    double correction = PyFloat_AsDouble(args[4]), floor_value = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_FLOAT64) || !(correction > 0) ||
        !(floor_value >= 0)) {
        PyErr_SetString(PyExc_ValueError, "ratio_sum: an argument is out of range");
        return NULL;
    }
    double total, bound = floor_value * correction;
    Py_BEGIN_ALLOW_THREADS
    total = dtype == DTYPE_FLOAT32
                ? ratio_f32((const float*)gradient, (const float*)second, n, correction, bound)
                : ratio_f64((const double*)gradient, (const double*)second, n, correction, bound);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(total);
}

/* difference_squares(after, before, out, n, dtype) -> float
 *
 * out = after - before over the ``n`` entries (three arrays of ``dtype``, dense; ``out`` may be
 * ``before``), and the sum of out^2 in double, GIL released: an optimizer step's update formed
 * in its parameter's copy, with the square of its l2 norm (``_step_tensors.updates``). */
static PyObject* difference_squares(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void *after, *before, *out;
    int64_t n, dtype;
    if (check_args(nargs, 5, "difference_squares") || as_pointer(args[0], &after) ||
        as_pointer(args[1], &before) || as_pointer(args[2], &out) || as_int64(args[3], &n) ||
        as_int64(args[4], &dtype))
        return NULL;
    if (n < 0 || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_FLOAT64)) {
        PyErr_SetString(PyExc_ValueError, "difference_squares: an argument is out of range");
        return NULL;
    }
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = dtype == DTYPE_FLOAT32
                ? difference_f32((const float*)after, (const float*)before, (float*)out, n)
                : difference_f64((const double*)after, (const double*)before, (double*)out, n);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(total);
}

/* shifted_squares(values, n, dtype, shift) -> float
 *
 * The sum of (x - shift)^2 over the n entries at ``values`` (float32 or float64, contiguous), in
 * double: the moments' second pass, the same loop ``profile`` runs. */
static PyObject* shifted_squares(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    void* values;
    int64_t n, dtype;
    if (check_args(nargs, 4, "shifted_squares") || as_pointer(args[0], &values) ||
        as_int64(args[1], &n) || as_int64(args[2], &dtype))
        return NULL;
    double shift = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_FLOAT64)) {
        PyErr_SetString(PyExc_ValueError, "shifted_squares: an argument is out of range");
        return NULL;
    }
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = dtype == DTYPE_FLOAT32 ? shifted_f32((const float*)values, n, shift)
                                   : shifted_f64((const double*)values, n, shift);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(total);
}

/* crc32c(data) -> int: the CRC-32C of a bytes-like object. */
static PyObject* crc32c_of(PyObject* module, PyObject* const* args, Py_ssize_t nargs) {
    (void)module;
    if (check_args(nargs, 1, "crc32c")) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c((const unsigned char*)view.buf, view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))reduce, METH_FASTCALL,
     "Sums, extremes, zeros, order statistics and histogram of one tensor."},
    {"profile", (PyCFunction)(void (*)(void))profile, METH_FASTCALL,
     "reduce, then the default profile's values in the working dtype."},
    {"histogram", (PyCFunction)(void (*)(void))histogram, METH_FASTCALL,
     "The grid and bins of one tensor whose min and max are known."},
    {"order_statistics", (PyCFunction)(void (*)(void))order_statistics, METH_FASTCALL,
     "Entries of the sorted subsample at the given ranks."},
    {"edges", (PyCFunction)(void (*)(void))edges, METH_FASTCALL,
     "The edges of a histogram grid: the first float of each bin."},
    {"draw", (PyCFunction)(void (*)(void))draw, METH_FASTCALL,
     "Uniform positions of a subsample, from a seed."},
    {"ratio_sum", (PyCFunction)(void (*)(void))ratio_sum, METH_FASTCALL,
     "Sum of g^2 / max(v / c, floor): Adam's gradient-to-second-moment ratio, squared, times n."},
    {"difference_squares", (PyCFunction)(void (*)(void))difference_squares, METH_FASTCALL,
     "out = after - before, and the sum of out^2 in double: an update and its squared norm."},
    {"shifted_squares", (PyCFunction)(void (*)(void))shifted_squares, METH_FASTCALL,
     "Sum of (x - shift)^2 in double: the moments' second pass."},
    {"crc32c", (PyCFunction)(void (*)(void))crc32c_of, METH_FASTCALL,
     "The CRC-32C of a bytes-like object."},
#ifdef TI_QUEUE
    {"queue_new", (PyCFunction)(void (*)(void))queue_new, METH_FASTCALL,
     "An empty reduction queue, whose thread runs profile's jobs without the GIL."},
    {"queue_submit", (PyCFunction)(void (*)(void))queue_submit, METH_FASTCALL,
     "Queue profile's work on one tensor; returns the job's ticket."},
    {"queue_copy", (PyCFunction)(void (*)(void))queue_copy, METH_FASTCALL,
     "Queue a copy of some bytes; returns the job's ticket."},
    {"queue_finished", (PyCFunction)(void (*)(void))queue_finished, METH_FASTCALL,
     "How many of the queue's jobs have run."},
    {"queue_helped", (PyCFunction)(void (*)(void))queue_helped, METH_FASTCALL,
     "How many of the queue's jobs a waiter ran itself."},
    {"queue_wakes", (PyCFunction)(void (*)(void))queue_wakes, METH_FASTCALL,
     "How many submits had to wake the queue's sleeping thread."},
    {"queue_wait", (PyCFunction)(void (*)(void))queue_wait, METH_FASTCALL,
     "Block until the job with a ticket has run, running queued jobs meanwhile."},
    {"queue_close", (PyCFunction)(void (*)(void))queue_close, METH_FASTCALL,
     "Run what is queued, then stop the queue's thread."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_kernels", "Compiled CPU reductions (see reducers/_native.py).", -1,
    methods,
};

/* The layout of the buffers the calls read and write, checked by ``_compiled.load`` (its
   ``LAYOUT``): a module built from older sources, which a failed rebuild leaves in place, would
   pass the size checks and leave new fields unwritten. 2: the histogram's edges follow it;
   3: ratio_sum; 4: the moments' second pass in profile, shifted_squares; 5: difference_squares;
   6: queue_copy, queue_helped, and a waiter that runs queued jobs; 7: a job run by its
   submitter counted in its turn, and queue_close returns once every job has run. */
#define KERNELS_LAYOUT 7

PyMODINIT_FUNC PyInit__kernels(void) {
    crc_prepare();
    PyObject* module = PyModule_Create(&module_definition);
    if (module == NULL) return NULL;
    if (PyModule_AddIntConstant(module, "LAYOUT", KERNELS_LAYOUT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#ifdef TI_QUEUE
    PyObject* longest = PyLong_FromLongLong(QUEUE_LINGER_MAX_NS);
    if (longest == NULL || PyModule_AddObject(module, "LINGER_MAX_NS", longest) < 0) {
        Py_XDECREF(longest);
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
