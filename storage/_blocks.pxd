# C declarations for the storage kernel: the XXH3 header, the file I/O header, and the
# AlignedBuffer type (so other Cython modules may cimport it).
from libc.stdint cimport uint8_t, uint64_t


cdef extern from "xxh3.h" nogil:
    ctypedef struct mk_xxh3_state:
        uint64_t total_len
        int nt_stores

    int MK_ISA_SCALAR, MK_ISA_SSE2, MK_ISA_AVX2, MK_ISA_AVX512, MK_ISA_NEON
    int mk_isa_supported(int isa)
    int mk_get_isa()
    int mk_set_isa(int isa)
    int mk_best_isa()

    uint64_t mk_xxh3_64(const void *data, size_t length, uint64_t seed)
    uint64_t mk_xxh3_64_isa(int isa, const void *data, size_t length, uint64_t seed)
    void mk_xxh3_init(mk_xxh3_state *st, uint64_t seed)
    void mk_xxh3_init_isa(mk_xxh3_state *st, uint64_t seed, int isa)
    void mk_xxh3_update(mk_xxh3_state *st, const uint8_t *p, size_t length)
    void mk_xxh3_update_copy(mk_xxh3_state *st, uint8_t *dst, const uint8_t *p, size_t length)
    void mk_xxh3_copy_verify(mk_xxh3_state *st, uint8_t *dst, const uint8_t *p, size_t length)
    uint64_t mk_xxh3_digest(const mk_xxh3_state *st)


cdef extern from "fileio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

    long long mk_pwrite_full(int fd, const char *p, size_t length, long long off, int *err)
    long long mk_pread_full(int fd, char *p, size_t length, long long off, int *err)
    long long mk_pwritev_full(int fd, iovec *iov, int cnt, long long off, int *err)
    long long mk_preadv_full(int fd, iovec *iov, int cnt, long long off, int *err)
    int IOV_MAX
    int mk_fsync(int fd)
    int mk_fdatasync(int fd)
    int mk_fsync_dir(const char *path, int *err)
    int mk_set_direct(int fd, int on, int *err)
    int mk_open_direct(const char *path, int flags, int mode, int want_direct, int *direct,
                       int *err)
    int mk_drop_cache(int fd, int *err)


cdef class AlignedBuffer:
    cdef char *_ptr
    cdef Py_ssize_t _nbytes
    cdef Py_ssize_t _alignment
    cdef Py_ssize_t _exports
    cdef bint _zero
    cdef bint _busy  # a resize is copying with the GIL released
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    cdef int _check_idle(self, str action) except -1
    cdef int _allocate(self, Py_ssize_t nbytes) except -1
