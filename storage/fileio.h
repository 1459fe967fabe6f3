/*
 * Full-length positional file I/O for mlxkv's storage kernel (called with the GIL released).
 * Every function reports failure through errno semantics: a negative return and *err set.
 * Platform differences live here so _blocks.pyx stays portable:
 *   - Linux: O_DIRECT toggled with fcntl(F_SETFL) (so O_CREAT|O_EXCL opens never need a
 *     retry), posix_fadvise(DONTNEED), fdatasync.
 *   - macOS: F_NOCACHE instead of O_DIRECT, no fadvise, fsync for fdatasync, and pwrite
 *     calls capped below INT_MAX bytes (larger ones fail with EINVAL there).
 */
#ifndef MLXKV_FILEIO_H
#define MLXKV_FILEIO_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MK_IO_CHUNK ((size_t)1 << 30) /* bytes per syscall: below every platform's cap */
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* Write all len bytes at off. Returns len, or -1 with *err = errno. */
static long long mk_pwrite_full(int fd, const char *p, size_t len, long long off, int *err) {
    size_t done = 0;
    while (done < len) {
        size_t n = len - done;
        if (n > MK_IO_CHUNK) n = MK_IO_CHUNK;
        ssize_t w = pwrite(fd, p + done, n, (off_t)(off + (long long)done));
        if (w < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (w == 0) { /* no progress and no error: do not spin */
            *err = EIO;
            return -1;
        }
        done += (size_t)w;
    }
    return (long long)done;
}

/* Read up to len bytes at off; short only at end of file. Returns bytes read or -1. */
static long long mk_pread_full(int fd, char *p, size_t len, long long off, int *err) {
    size_t done = 0;
    while (done < len) {
        size_t n = len - done;
        if (n > MK_IO_CHUNK) n = MK_IO_CHUNK;
        ssize_t r = pread(fd, p + done, n, (off_t)(off + (long long)done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (r == 0) break; /* EOF */
        done += (size_t)r;
    }
    return (long long)done;
}

#if defined(__linux__)
/* Drop the first n bytes of the vectors, and the empty vectors that follow them: *iov and *cnt
 * move past what is done, and a partly done vector is advanced into. */
static void mk_iov_consume(struct iovec **iov, int *cnt, size_t n) {
    while (*cnt > 0 && n >= (*iov)->iov_len) {
        n -= (*iov)->iov_len;
        (*iov)++;
        (*cnt)--;
    }
    if (n) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + n;
        (*iov)->iov_len -= n;
    }
}
#endif

/* Write every iovec in order starting at off; iov is consumed (modified). */
static long long mk_pwritev_full(int fd, struct iovec *iov, int cnt, long long off, int *err) {
    long long done = 0;
#if defined(__linux__)
    for (mk_iov_consume(&iov, &cnt, 0); cnt > 0;) {
        int batch = cnt < IOV_MAX ? cnt : IOV_MAX;
        ssize_t w = pwritev(fd, iov, batch, (off_t)(off + done));
        if (w < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (w == 0) {
            *err = EIO;
            return -1;
        }
        done += w;
        mk_iov_consume(&iov, &cnt, (size_t)w);
    }
#else
    /* pwritev is missing from older macOS SDKs: one full pwrite per vector. */
    for (int i = 0; i < cnt; i++) {
        long long w = mk_pwrite_full(fd, (const char *)iov[i].iov_base, iov[i].iov_len, off + done, err);
        if (w < 0) return -1;
        done += w;
    }
#endif
    return done;
}

/* Read into every iovec in order starting at off; iov is consumed (modified). Returns the bytes
 * read (fewer than the vectors hold only at end of file) or -1 with *err = errno. */
static long long mk_preadv_full(int fd, struct iovec *iov, int cnt, long long off, int *err) {
    long long done = 0;
#if defined(__linux__)
    for (mk_iov_consume(&iov, &cnt, 0); cnt > 0;) {
        int batch = cnt < IOV_MAX ? cnt : IOV_MAX;
        ssize_t r = preadv(fd, iov, batch, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (r == 0) break; /* EOF */
        done += r;
        mk_iov_consume(&iov, &cnt, (size_t)r);
    }
#else
    /* preadv is missing from older macOS SDKs: one full pread per vector. */
    for (int i = 0; i < cnt; i++) {
        long long r = mk_pread_full(fd, (char *)iov[i].iov_base, iov[i].iov_len, off + done, err);
        if (r < 0) return -1;
        done += r;
        if ((size_t)r < iov[i].iov_len) break; /* EOF */
    }
#endif
    return done;
}

static int mk_fsync(int fd) {
    int r;
    do r = fsync(fd); while (r < 0 && errno == EINTR);
    return r;
}

static int mk_fdatasync(int fd) {
#if defined(__linux__)
    int r;
    do r = fdatasync(fd); while (r < 0 && errno == EINTR);
    return r;
#else
    return mk_fsync(fd);
#endif
}

/* fsync a directory so a rename or unlink inside it is durable. */
static int mk_fsync_dir(const char *path, int *err) {
    int flags = O_RDONLY;
#ifdef O_DIRECTORY
    flags |= O_DIRECTORY;
#endif
#ifdef O_CLOEXEC
    flags |= O_CLOEXEC;
#endif
    int fd;
    do fd = open(path, flags); while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    int r = mk_fsync(fd);
    if (r < 0) *err = errno;
    close(fd);
    return r;
}

/* Turn the page-cache bypass on or off for fd: 1 = done, 0 = not supported here, -1 = error. */
static int mk_set_direct(int fd, int on, int *err) {
#if defined(__linux__) && defined(O_DIRECT)
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
        *err = errno;
        return -1;
    }
    fl = on ? (fl | O_DIRECT) : (fl & ~O_DIRECT);
    if (fcntl(fd, F_SETFL, fl) < 0) {
        if (errno == EINVAL || errno == EOPNOTSUPP) return 0; /* filesystem without O_DIRECT */
        *err = errno;
        return -1;
    }
    return 1;
#elif defined(__APPLE__) && defined(F_NOCACHE)
    if (fcntl(fd, F_NOCACHE, on ? 1 : 0) < 0) {
        if (errno == EINVAL || errno == ENOTSUP) return 0;
        *err = errno;
        return -1;
    }
    return 1;
#else
    (void)fd; (void)on; (void)err;
    return 0;
#endif
}

/* open() then try to bypass the page cache; *direct says whether that worked. */
static int mk_open_direct(const char *path, int flags, int mode, int want_direct, int *direct,
                          int *err) {
#ifdef O_CLOEXEC
    flags |= O_CLOEXEC;
#endif
    int fd;
    do fd = open(path, flags, mode); while (fd < 0 && errno == EINTR);
    *direct = 0;
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    if (want_direct) {
        int r = mk_set_direct(fd, 1, err);
        if (r < 0) {
            close(fd);
            return -1;
        }
        *direct = r;
    }
    return fd;
}

/* Ask the kernel to drop fd's clean cached pages: 1 = asked, 0 = not supported, -1 = error. */
static int mk_drop_cache(int fd, int *err) {
#if defined(__linux__) && defined(POSIX_FADV_DONTNEED)
    int r = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    if (r != 0) {
        *err = r;
        return -1;
    }
    return 1;
#else
    (void)fd; (void)err;
    return 0;
#endif
}

#endif /* MLXKV_FILEIO_H */
