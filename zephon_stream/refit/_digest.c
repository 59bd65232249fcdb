/* The additive model digest (zephon_stream.refit.hashing) as compiled loops.
 *
 *     digest = sum over words of mix(p, v)  (mod 2**64)
 *     mix(p, v) = fmix(v * K2 + p * K1),  fmix: the splitmix64 finalizer (xor-shift 31, *K3,
 *                                          xor-shift 29, *K1, xor-shift 32)
 *
 * p is a word's canonical byte offset, v its bits zero-extended to 64. The numpy version in
 * hashing.py is the reference: every function here returns exactly what it returns (tested).
 * Each call releases the GIL, so worker threads hash chunks on every core at once.
 *
 * Words of up to 32 bits (bf16, fp16, fp32, int8) take hand-written AVX2 loops where the CPU has
 * AVX2 (checked when the module loads; `set_simd(False)` selects the portable loops, for tests):
 * AVX2 has no 64-bit multiply, and v < 2**32 lets v * K2 take two 32x32->64 multiplies instead
 * of three, with two independent chains per iteration. The portable loops are plain C that gcc
 * auto-vectorizes per target (target_clones), and the only code on other architectures.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K1 0x9E3779B97F4A7C15ULL
#define K2 0xBF58476D1CE4E5B9ULL
#define K3 0x94D049BB133111EBULL

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline uint64_t fmix(uint64_t x) {
    x ^= x >> 31;
    x *= K3;
    x ^= x >> 29;
    x *= K1;
    x ^= x >> 32;
    return x;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2 1
#define AVX2 __attribute__((target("avx2")))
#define SWAP(K) ((long long)(((K) >> 32) | ((K) << 32)))

/* x * K mod 2**64, lane by lane. klo: lo(K) in each lane; kswap: hi(K) in the low and lo(K) in
   the high 32 bits of each lane. lo(x) * lo(K) needs all 64 bits of its product; the cross terms
   lo(x) * hi(K) + hi(x) * lo(K) only their low 32 (they are shifted up by 32), which one 32-bit
   multiply of x by kswap gives for both at once. */
AVX2 static inline __m256i mul64(__m256i x, __m256i klo, __m256i kswap) {
    __m256i cross = _mm256_mullo_epi32(x, kswap);
    cross = _mm256_add_epi32(cross, _mm256_srli_epi64(cross, 32));
    return _mm256_add_epi64(_mm256_mul_epu32(x, klo), _mm256_slli_epi64(cross, 32));
}

/* mix(p, v) of four words v < 2**32 (zero-extended in 64-bit lanes), pk = p * K1 per lane. */
AVX2 static inline __m256i mix4(__m256i v, __m256i pk) {
    const __m256i k2lo = _mm256_set1_epi64x(K2 & 0xFFFFFFFFULL), k2hi = _mm256_set1_epi64x(K2 >> 32);
    const __m256i k3lo = _mm256_set1_epi64x(K3 & 0xFFFFFFFFULL), k3hi = _mm256_set1_epi64x(SWAP(K3));
    const __m256i k1lo = _mm256_set1_epi64x(K1 & 0xFFFFFFFFULL), k1hi = _mm256_set1_epi64x(SWAP(K1));
    __m256i x = _mm256_add_epi64(_mm256_mul_epu32(v, k2lo), _mm256_slli_epi64(_mm256_mul_epu32(v, k2hi), 32));
    x = _mm256_add_epi64(x, pk);
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
    x = mul64(x, k3lo, k3hi);
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 29));
    x = mul64(x, k1lo, k1hi);
    return _mm256_xor_si256(x, _mm256_srli_epi64(x, 32));
}

AVX2 static inline uint64_t hsum(__m256i a) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

/* p * K1 for the four words from byte offset `at`, `size` bytes apart. */
AVX2 static inline __m256i ramp4(uint64_t at, uint64_t size) {
    uint64_t s = size * K1, p = at * K1;
    return _mm256_setr_epi64x((long long)p, (long long)(p + s), (long long)(p + 2 * s), (long long)(p + 3 * s));
}

/* The main loops take 16 words per step as four vectors of four (a, b, c, d, in order), and
   leave the tail (< 16 words) to the scalar loop: each returns how many words it did. */
#define AVX2_LOOP(...)                                                                        \
    const __m256i d4 = _mm256_set1_epi64x((long long)(4 * size * K1));                       \
    const __m256i d16 = _mm256_set1_epi64x((long long)(16 * size * K1));                     \
    __m256i pk = ramp4(base, size), acc0 = _mm256_setzero_si256(), acc1 = acc0;              \
    Py_ssize_t i = 0;                                                                         \
    for (; i + 16 <= n; i += 16) {                                                            \
        __m256i a, b, c, d;                                                                   \
        __VA_ARGS__                                                                           \
        __m256i pk1 = _mm256_add_epi64(pk, d4), pk2 = _mm256_add_epi64(pk1, d4);              \
        acc0 = _mm256_add_epi64(acc0, mix4(a, pk));                                           \
        acc1 = _mm256_add_epi64(acc1, mix4(b, pk1));                                          \
        acc0 = _mm256_add_epi64(acc0, mix4(c, pk2));                                          \
        acc1 = _mm256_add_epi64(acc1, mix4(d, _mm256_add_epi64(pk2, d4)));                    \
        pk = _mm256_add_epi64(pk, d16);                                                       \
    }                                                                                         \
    *total = hsum(_mm256_add_epi64(acc0, acc1));                                              \
    return i;

AVX2 static Py_ssize_t run8_avx2(const uint8_t *v, Py_ssize_t n, uint64_t base, uint64_t *total) {
    const uint64_t size = 1;
    AVX2_LOOP(__m128i w = _mm_loadu_si128((const __m128i *)(v + i));
              a = _mm256_cvtepu8_epi64(w); b = _mm256_cvtepu8_epi64(_mm_srli_si128(w, 4));
              c = _mm256_cvtepu8_epi64(_mm_srli_si128(w, 8)); d = _mm256_cvtepu8_epi64(_mm_srli_si128(w, 12));)
}

AVX2 static Py_ssize_t run16_avx2(const uint16_t *v, Py_ssize_t n, uint64_t base, uint64_t *total) {
    const uint64_t size = 2;
    AVX2_LOOP(__m128i w0 = _mm_loadu_si128((const __m128i *)(v + i));
              __m128i w1 = _mm_loadu_si128((const __m128i *)(v + i + 8));
              a = _mm256_cvtepu16_epi64(w0); b = _mm256_cvtepu16_epi64(_mm_srli_si128(w0, 8));
              c = _mm256_cvtepu16_epi64(w1); d = _mm256_cvtepu16_epi64(_mm_srli_si128(w1, 8));)
}

AVX2 static Py_ssize_t run32_avx2(const uint32_t *v, Py_ssize_t n, uint64_t base, uint64_t *total) {
    const uint64_t size = 4;
    AVX2_LOOP(a = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(v + i)));
              b = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(v + i + 4)));
              c = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(v + i + 8)));
              d = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(v + i + 12)));)
}

AVX2 static Py_ssize_t weave16_avx2(const uint8_t *lo, const uint8_t *hi, uint16_t *out, Py_ssize_t n,
                                    uint64_t base, uint64_t *total) {
    const uint64_t size = 2;
    AVX2_LOOP(__m128i l = _mm_loadu_si128((const __m128i *)(lo + i));
              __m128i h = _mm_loadu_si128((const __m128i *)(hi + i));
              __m128i w0 = _mm_unpacklo_epi8(l, h), w1 = _mm_unpackhi_epi8(l, h);
              _mm_storeu_si128((__m128i *)(out + i), w0); _mm_storeu_si128((__m128i *)(out + i + 8), w1);
              a = _mm256_cvtepu16_epi64(w0); b = _mm256_cvtepu16_epi64(_mm_srli_si128(w0, 8));
              c = _mm256_cvtepu16_epi64(w1); d = _mm256_cvtepu16_epi64(_mm_srli_si128(w1, 8));)
}

AVX2 static Py_ssize_t weave32_avx2(const uint8_t *const *p, uint32_t *out, Py_ssize_t n, uint64_t base,
                                    uint64_t *total) {
    const uint64_t size = 4;
    AVX2_LOOP(__m128i b0 = _mm_loadu_si128((const __m128i *)(p[0] + i));
              __m128i b1 = _mm_loadu_si128((const __m128i *)(p[1] + i));
              __m128i b2 = _mm_loadu_si128((const __m128i *)(p[2] + i));
              __m128i b3 = _mm_loadu_si128((const __m128i *)(p[3] + i));
              __m128i t0 = _mm_unpacklo_epi8(b0, b1), t1 = _mm_unpackhi_epi8(b0, b1);
              __m128i t2 = _mm_unpacklo_epi8(b2, b3), t3 = _mm_unpackhi_epi8(b2, b3);
              __m128i w0 = _mm_unpacklo_epi16(t0, t2), w1 = _mm_unpackhi_epi16(t0, t2);
              __m128i w2 = _mm_unpacklo_epi16(t1, t3), w3 = _mm_unpackhi_epi16(t1, t3);
              _mm_storeu_si128((__m128i *)(out + i), w0); _mm_storeu_si128((__m128i *)(out + i + 4), w1);
              _mm_storeu_si128((__m128i *)(out + i + 8), w2); _mm_storeu_si128((__m128i *)(out + i + 12), w3);
              a = _mm256_cvtepu32_epi64(w0); b = _mm256_cvtepu32_epi64(w1);
              c = _mm256_cvtepu32_epi64(w2); d = _mm256_cvtepu32_epi64(w3);)
}
#else
#define HAVE_AVX2 0
#endif

static int simd = 0; /* whether the AVX2 loops are in use: set when the module loads */

/* Words laid back to back from canonical byte offset `base`. */
#define CONTIGUOUS(NAME, T)                                                              \
    MULTIVERSION static uint64_t NAME(const T *v, Py_ssize_t n, uint64_t base) {         \
        const uint64_t step = (uint64_t)sizeof(T) * K1;                                  \
        uint64_t total = 0, pk = base * K1;                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            total += fmix((uint64_t)v[i] * K2 + pk + (uint64_t)i * step);                \
        }                                                                                \
        return total;                                                                    \
    }
CONTIGUOUS(run8, uint8_t)
CONTIGUOUS(run16, uint16_t)
CONTIGUOUS(run32, uint32_t)
CONTIGUOUS(run64, uint64_t)

/* Words at explicit canonical byte offsets. */
#define SCATTERED(NAME, T)                                                               \
    MULTIVERSION static uint64_t NAME(const T *v, const uint64_t *pos, Py_ssize_t n) {   \
        uint64_t total = 0;                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            total += fmix((uint64_t)v[i] * K2 + pos[i] * K1);                            \
        }                                                                                \
        return total;                                                                    \
    }
SCATTERED(at8, uint8_t)
SCATTERED(at16, uint16_t)
SCATTERED(at32, uint32_t)
SCATTERED(at64, uint64_t)

/* Two byte planes (low byte first) woven into 16-bit words, hashed in the same pass. */
MULTIVERSION static uint64_t weave16(const uint8_t *lo, const uint8_t *hi, uint16_t *out, Py_ssize_t n,
                                     uint64_t base) {
    const uint64_t step = 2 * K1;
    uint64_t total = 0, pk = base * K1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t w = (uint16_t)(lo[i] | ((uint16_t)hi[i] << 8));
        out[i] = w;
        total += fmix((uint64_t)w * K2 + pk + (uint64_t)i * step);
    }
    return total;
}

MULTIVERSION static uint64_t weave32(const uint8_t *const *p, uint32_t *out, Py_ssize_t n, uint64_t base) {
    const uint64_t step = 4 * K1;
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    uint64_t total = 0, pk = base * K1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
        out[i] = w;
        total += fmix((uint64_t)w * K2 + pk + (uint64_t)i * step);
    }
    return total;
}

static uint64_t weave_any(const uint8_t *const *p, int itemsize, uint8_t *out, Py_ssize_t n, uint64_t base) {
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w = 0;
        for (int b = 0; b < itemsize; b++) {
            out[i * itemsize + b] = p[b][i];
            w |= (uint64_t)p[b][i] << (8 * b);
        }
        total += fmix(w * K2 + (base + (uint64_t)i * itemsize) * K1);
    }
    return total;
}

static int get_u64(PyObject *obj, uint64_t *out) {
    unsigned long long x = PyLong_AsUnsignedLongLongMask(obj);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)x;
    return 0;
}

static int check_itemsize(int itemsize) {
    if (itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8) return 0;
    PyErr_Format(PyExc_ValueError, "itemsize %d is not 1, 2, 4 or 8", itemsize);
    return -1;
}

static uint64_t run_any(const void *v, Py_ssize_t n, int itemsize, uint64_t base) {
    uint64_t total = 0;
    Py_ssize_t done = 0;
#if HAVE_AVX2
    if (simd && itemsize == 1) done = run8_avx2(v, n, base, &total);
    if (simd && itemsize == 2) done = run16_avx2(v, n, base, &total);
    if (simd && itemsize == 4) done = run32_avx2(v, n, base, &total);
#endif
    const char *rest = (const char *)v + done * itemsize;
    base += (uint64_t)done * itemsize;
    switch (itemsize) {
    case 1: return total + run8((const uint8_t *)rest, n - done, base);
    case 2: return total + run16((const uint16_t *)rest, n - done, base);
    case 4: return total + run32((const uint32_t *)rest, n - done, base);
    default: return total + run64((const uint64_t *)rest, n - done, base);
    }
}

/* out's words from byte planes, and their digest from `base` (the AVX2 loop, then the rest). */
static uint64_t weave_run(const uint8_t *const *p, int itemsize, void *out, Py_ssize_t n, uint64_t base) {
    uint64_t total = 0;
    Py_ssize_t done = 0;
    const uint8_t *q[8];
#if HAVE_AVX2
    if (simd && itemsize == 2) done = weave16_avx2(p[0], p[1], out, n, base, &total);
    if (simd && itemsize == 4) done = weave32_avx2(p, out, n, base, &total);
#endif
    for (int b = 0; b < itemsize; b++) q[b] = p[b] + done;
    uint8_t *rest = (uint8_t *)out + done * itemsize;
    n -= done;
    base += (uint64_t)done * itemsize;
    if (itemsize == 1) {
        memcpy(rest, q[0], n);
        return total + run8(q[0], n, base);
    }
    if (itemsize == 2) return total + weave16(q[0], q[1], (uint16_t *)rest, n, base);
    if (itemsize == 4) return total + weave32(q, (uint32_t *)rest, n, base);
    return total + weave_any(q, itemsize, rest, n, base);
}

/* contiguous_sum(base, itemsize, values) -> int */
static PyObject *py_contiguous_sum(PyObject *self, PyObject *args) {
    PyObject *base_obj;
    int itemsize;
    Py_buffer v;
    uint64_t base, total;
    if (!PyArg_ParseTuple(args, "Oiy*", &base_obj, &itemsize, &v)) return NULL;
    if (get_u64(base_obj, &base) < 0 || check_itemsize(itemsize) < 0) goto fail;
    if (v.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole %d-byte words", v.len, itemsize);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    total = run_any(v.buf, v.len / itemsize, itemsize, base);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(total);
fail:
    PyBuffer_Release(&v);
    return NULL;
}

/* element_sum(positions (uint64 or int64 words), itemsize, values) -> int */
static PyObject *py_element_sum(PyObject *self, PyObject *args) {
    int itemsize;
    Py_buffer pos, v;
    uint64_t total = 0;
    if (!PyArg_ParseTuple(args, "y*iy*", &pos, &itemsize, &v)) return NULL;
    if (check_itemsize(itemsize) < 0) goto fail;
    Py_ssize_t n = pos.len / 8;
    if (pos.len % 8 || v.len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd position bytes and %zd value bytes are not matching arrays of 8-byte "
                     "positions and %d-byte words", pos.len, v.len, itemsize);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: total = at8(v.buf, pos.buf, n); break;
    case 2: total = at16(v.buf, pos.buf, n); break;
    case 4: total = at32(v.buf, pos.buf, n); break;
    default: total = at64(v.buf, pos.buf, n); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pos);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(total);
fail:
    PyBuffer_Release(&pos);
    PyBuffer_Release(&v);
    return NULL;
}

/* A byte plane handed over in pieces: the buffers of one object, or of each item of a tuple
   (a keyframe's raw plane, read in place inside its zstd frame), consumed in order. */
typedef struct {
    Py_buffer *bufs;
    Py_ssize_t count, at, off; /* pieces; the piece and the byte in it where the next span starts */
} pieces_t;

static int get_pieces(PyObject *plane, pieces_t *pc, Py_buffer *store, Py_ssize_t *used, Py_ssize_t *len) {
    Py_ssize_t n = PyTuple_Check(plane) ? PyTuple_GET_SIZE(plane) : 1;
    pc->bufs = store + *used, pc->count = 0, pc->at = 0, pc->off = 0, *len = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *o = PyTuple_Check(plane) ? PyTuple_GET_ITEM(plane, j) : plane;
        if (PyObject_GetBuffer(o, &pc->bufs[j], PyBUF_SIMPLE) < 0) return -1;
        pc->count++, (*used)++, *len += pc->bufs[j].len;
    }
    return 0;
}

/* The next `span` bytes at most that every plane holds contiguously; p[k]: where each starts. */
static Py_ssize_t next_span(pieces_t *pc, int itemsize, const uint8_t **p, Py_ssize_t span) {
    for (int k = 0; k < itemsize; k++) {
        while (pc[k].off == pc[k].bufs[pc[k].at].len) pc[k].at++, pc[k].off = 0; /* empty pieces */
        Py_ssize_t left = pc[k].bufs[pc[k].at].len - pc[k].off;
        if (left < span) span = left;
        p[k] = (const uint8_t *)pc[k].bufs[pc[k].at].buf + pc[k].off;
    }
    for (int k = 0; k < itemsize; k++) pc[k].off += span;
    return span;
}

/* weave_sum(base, planes, out) -> int: out's words from byte planes (plane b: byte b of each
   word, little-endian order), and their contiguous digest from `base`, in one pass. A plane is
   a buffer, or a tuple of buffers that are its pieces in order. */
static PyObject *py_weave_sum(PyObject *self, PyObject *args) {
    PyObject *base_obj, *planes;
    Py_buffer out, *store = NULL;
    pieces_t pc[8];
    const uint8_t *p[8];
    int itemsize;
    Py_ssize_t used = 0, total_pieces = 0, len;
    uint64_t base, total = 0;
    if (!PyArg_ParseTuple(args, "OO!w*", &base_obj, &PyTuple_Type, &planes, &out)) return NULL;
    itemsize = (int)PyTuple_GET_SIZE(planes);
    if (get_u64(base_obj, &base) < 0 || check_itemsize(itemsize) < 0) goto fail;
    Py_ssize_t n = out.len / itemsize;
    if (out.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole %d-byte words", out.len, itemsize);
        goto fail;
    }
    for (int k = 0; k < itemsize; k++) {
        PyObject *plane = PyTuple_GET_ITEM(planes, k);
        total_pieces += PyTuple_Check(plane) ? PyTuple_GET_SIZE(plane) : 1;
    }
    store = PyMem_Calloc(total_pieces ? total_pieces : 1, sizeof(Py_buffer));
    if (store == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int k = 0; k < itemsize; k++) {
        if (get_pieces(PyTuple_GET_ITEM(planes, k), &pc[k], store, &used, &len) < 0) goto fail;
        if (len != n) {
            PyErr_Format(PyExc_ValueError, "plane %d holds %zd bytes, the output %zd words", k, len, n);
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t done = 0; done < n;) {
        Py_ssize_t span = next_span(pc, itemsize, p, n - done);
        total += weave_run(p, itemsize, (uint8_t *)out.buf + done * itemsize, span, base + (uint64_t)done * itemsize);
        done += span;
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < used; j++) PyBuffer_Release(&store[j]);
    PyMem_Free(store);
    PyBuffer_Release(&out);
    return PyLong_FromUnsignedLongLong(total);
fail:
    for (Py_ssize_t j = 0; j < used; j++) PyBuffer_Release(&store[j]);
    PyMem_Free(store);
    PyBuffer_Release(&out);
    return NULL;
}

/* set_simd(enabled) -> bool: use the AVX2 loops (where the CPU has them) or the portable ones;
   returns the previous setting. For tests, which check both against the numpy reference. */
static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
    int was = simd;
#if HAVE_AVX2
    __builtin_cpu_init();
    simd = want && __builtin_cpu_supports("avx2");
#endif
    return PyBool_FromLong(was);
}

/* simd() -> bool: whether the AVX2 loops are in use. */
static PyObject *py_simd(PyObject *self, PyObject *unused) { return PyBool_FromLong(simd); }

static PyMethodDef methods[] = {
    {"contiguous_sum", py_contiguous_sum, METH_VARARGS, "sum of mix over words laid back to back from `base`"},
    {"element_sum", py_element_sum, METH_VARARGS, "sum of mix over words at 8-byte canonical positions"},
    {"weave_sum", py_weave_sum, METH_VARARGS, "weave byte planes into words and return their digest, one pass"},
    {"set_simd", py_set_simd, METH_O, "use the AVX2 loops where the CPU has them (True) or the portable ones"},
    {"simd", py_simd, METH_NOARGS, "whether the AVX2 loops are in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_digest", NULL, -1, methods};

PyMODINIT_FUNC PyInit__digest(void) {
#if HAVE_AVX2
    __builtin_cpu_init();
    simd = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
