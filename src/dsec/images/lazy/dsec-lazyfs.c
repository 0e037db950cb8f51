/*
 * dsec-lazyfs: remote EROFS layer blobs as read-only files, fetched in verified chunks.
 *
 * The platform mounts EROFS straight from <mount>/<hex> (a file-backed EROFS mount), so
 * the kernel keeps doing everything a file system does (inodes, directories, page
 * cache shared by every sandbox on the host); this daemon only answers "give me bytes
 * [off, off+len) of blob <hex>". A byte range is served from the host chunk cache
 * (<cache>/<hex>/data, a sparse file) when its chunks are there; missing chunks are
 * fetched from the layer store (an HTTP(S) blob server or a shared file system path),
 * checked against the per-chunk SHA-256 digests of the layer's index, written to the
 * cache, and only then served. A chunk that fails verification is never served (EIO).
 * Concurrent first reads of one chunk fetch it once: the first reader claims it, the
 * others wait for it.
 *
 * It speaks the kernel FUSE protocol on /dev/fuse directly (no libfuse needed) with a
 * pool of worker threads, each blocking in read(2) on the device.
 *
 * Per layer, written by the platform before the first open:
 *   <cache>/<hex>/index    "DSECIDX1" header + one SHA-256 per chunk (verified by the
 *                          platform against the index digest in the registry)
 * Kept by this daemon:
 *   <cache>/<hex>/data     sparse cache of the blob
 *   <cache>/<hex>/present  one byte per chunk, 1 = stored (a hint: a chunk read from the
 *                          cache is re-verified once per daemon lifetime)
 * <mount>/.stats is a text file of counters.
 *
 * usage: dsec-lazyfs --mount DIR --cache DIR --store URL|PATH [--token-file F]
 *                    [--auth-file F] [--ca-file PEM] [--threads N] [--timeout SECONDS]
 *                    [--readahead BYTES] [--ready-fd FD] [--direct-io] [--nice N]
 *
 * An https:// store is spoken with OpenSSL: the server's certificate chain is verified
 * against the system CA store (or only the bundle --ca-file names) and must name the
 * store's host (DNS name or IP address); there is no way to turn that off (a plain-HTTP
 * store has to be named http://). Each worker keeps one TLS connection alive.
 *
 * --auth-file holds the Authorization header value. Registry bearer tokens expire: the
 * platform rewrites the file (atomically, by rename) with a fresh one before that, and
 * a request answered 401 makes the worker re-read the file and try once more.
 *
 * --nice: the workers' scheduling priority. A cold read is a chain of wake-ups (reader,
 * this daemon, the store); on a busy host each one can wait a time slice, so the
 * platform runs the daemon slightly ahead of the sandboxes (it uses little CPU).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define INDEX_MAGIC "DSECIDX1"
#define INDEX_HEADER 64 /* magic 8, version 4, chunk 4, size 8, nchunks 8, blob sha 32 */
#define MAX_READ (1u << 20)
#define STATS_INO 2
#define FIRST_LAYER_INO 16
#define ATTR_TTL 86400 /* layers are immutable: content never changes under a name */

/* READY_SPEC: fetched by readahead, not asked for yet (READY for every reader). */
enum { ABSENT = 0, ONDISK = 1, BUSY = 2, READY = 3, READY_SPEC = 4 };

/* Readahead of neighbouring chunks for sequential readers of a blob: a read that
 * ends in missing chunks and continues where an earlier fetch of the layer ended (a
 * stream; RA_STREAMS tracked per layer) also fetches the next missing chunks in the
 * same range request, a window that starts at RA_FIRST and doubles per continuation up
 * to RA_CHUNKS. A read that starts a new stream fetches only what it asked for (tried:
 * reading ahead there too was wasted half the time, since the neighbours of a random
 * read are mostly being fetched by other readers already, or not read at all). On a
 * busy host every store round trip is a chain of wake-ups, so fewer, larger requests
 * help. Bounded so that it cannot inflate what is fetched: while more than RA_SLACK +
 * fetched/RA_WASTE_DIV chunks read ahead sit unread, none is issued (random access
 * turns it off; at most ~6% + 1 MiB of a layer's fetches can be wasted). */
#define RA_FIRST 2
#define RA_CHUNKS 15
#define RA_STREAMS 8
#define RA_SLACK 16
#define RA_WASTE_DIV 16

/* ---------------------------------------------------------------- settings, stats */

static const char *g_mount, *g_cache, *g_store;
static char g_auth[4096]; /* the Authorization header value, "" for none (under g_auth_mu) */
static pthread_mutex_t g_auth_mu = PTHREAD_MUTEX_INITIALIZER;
static const char *g_cred_file; /* --auth-file or --token-file, re-read on a 401 */
static int g_cred_bearer;       /* --token-file: the file holds a bare bearer token */
static const char *g_ca_file;   /* --ca-file: trust only this bundle (https stores) */
static SSL_CTX *g_ssl_ctx;      /* https:// stores */
static int g_tls, g_host_is_ip;
static const char *g_blob_prefix = "/v1/blobs/"; /* <prefix><blob_prefix>sha256:<hex> */
static int g_threads = 16, g_timeout = 10, g_direct_io = 0, g_ready_fd = -1, g_nice = 0;
static unsigned g_readahead = 128 * 1024;
static char g_host[320], g_port[320], g_prefix[512];
static int g_http;
static int g_fuse = -1;
static atomic_int g_stop;

static atomic_ullong st_read_reqs, st_read_bytes, st_fetch_reqs, st_fetch_bytes, st_fetch_errors,
    st_chunks_fetched, st_chunks_verified_disk, st_verify_failures, st_waits, st_cache_write_bytes,
    st_ra_chunks, st_ra_used, st_auth_reloads;

static void logmsg(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

/* ---------------------------------------------------------------- SHA-256 */
/* libcrypto's SHA-NI code when it can be loaded (always on Debian: Python links it),
 * else a portable implementation written from FIPS 180-4. */

typedef unsigned char *(*sha256_fn)(const unsigned char *, size_t, unsigned char *);
static sha256_fn g_sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

static void sha256_portable(const unsigned char *data, size_t len, unsigned char out[32]) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t i = 0;
    for (; i + 64 <= len; i += 64) sha256_block(h, data + i);
    unsigned char tail[128] = {0};
    size_t rest = len - i;
    memcpy(tail, data + i, rest);
    tail[rest] = 0x80;
    size_t total = rest + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    for (int j = 0; j < 8; j++) tail[total - 1 - j] = (unsigned char)(bits >> (8 * j));
    sha256_block(h, tail);
    if (total == 128) sha256_block(h, tail + 64);
    for (int j = 0; j < 8; j++) {
        out[4 * j] = (unsigned char)(h[j] >> 24);
        out[4 * j + 1] = (unsigned char)(h[j] >> 16);
        out[4 * j + 2] = (unsigned char)(h[j] >> 8);
        out[4 * j + 3] = (unsigned char)h[j];
    }
}

static void sha256(const unsigned char *data, size_t len, unsigned char out[32]) {
    if (g_sha256) g_sha256(data, len, out);
    else sha256_portable(data, len, out);
}

static void sha256_init_impl(void) {
    void *lib = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (lib) g_sha256 = (sha256_fn)dlsym(lib, "SHA256");
    unsigned char a[32], b[32];
    const unsigned char probe[] = "dsec-lazyfs sha256 self-test, long enough for two blocks of input data!!";
    sha256_portable(probe, sizeof probe - 1, a);
    if (g_sha256) {
        g_sha256(probe, sizeof probe - 1, b);
        if (memcmp(a, b, 32) != 0) {
            logmsg("dsec-lazyfs: libcrypto SHA256 disagrees with ours; using ours");
            g_sha256 = NULL;
        }
    }
}

/* ---------------------------------------------------------------- layers */

struct layer {
    char hex[65];
    uint64_t ino, size, nchunks;
    uint32_t chunk;
    int opens;
    uint64_t spec_unread, demand_chunks; /* readahead budget (under mu) */
    uint64_t ra_next[RA_STREAMS];        /* first chunk after each stream's last fetch */
    uint32_t ra_win[RA_STREAMS], ra_rr;
    unsigned char *digests; /* nchunks * 32, loaded on first open */
    uint8_t *state;
    int data_fd, present_fd, src_fd;
    atomic_ullong fetched;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static pthread_mutex_t g_layers_mu = PTHREAD_MUTEX_INITIALIZER;
static struct layer **g_layers;
static size_t g_nlayers, g_cap;

static int is_hex64(const char *s, size_t n) {
    if (n != 64) return 0;
    for (size_t i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Reads the index header: 0 and fills size/chunk/nchunks, or -errno. */
static int read_header(const char *hex, uint64_t *size, uint32_t *chunk, uint64_t *nchunks) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/index", g_cache, hex);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -ENOENT;
    unsigned char h[INDEX_HEADER];
    ssize_t n = pread(fd, h, sizeof h, 0);
    struct stat st;
    int ok = n == (ssize_t)sizeof h && fstat(fd, &st) == 0 && memcmp(h, INDEX_MAGIC, 8) == 0 &&
             le32(h + 8) == 1;
    close(fd);
    if (!ok) return -EIO;
    *chunk = le32(h + 12);
    *size = le64(h + 16);
    *nchunks = le64(h + 24);
    if (*chunk == 0 || *chunk % 4096 || *nchunks != (*size + *chunk - 1) / *chunk ||
        (uint64_t)st.st_size != INDEX_HEADER + *nchunks * 32)
        return -EIO;
    return 0;
}

static struct layer *layer_by_ino(uint64_t ino) {
    struct layer *l = NULL;
    pthread_mutex_lock(&g_layers_mu);
    if (ino >= FIRST_LAYER_INO && ino - FIRST_LAYER_INO < g_nlayers)
        l = g_layers[ino - FIRST_LAYER_INO];
    pthread_mutex_unlock(&g_layers_mu);
    return l;
}

/* The layer named hex (its inode stays for the daemon's lifetime; a blob's content never
 * changes, only whether its cache exists). -errno if there is no index for it. */
static int layer_lookup(const char *hex, struct layer **out) {
    uint64_t size, nchunks;
    uint32_t chunk;
    int rc = read_header(hex, &size, &chunk, &nchunks);
    if (rc) return rc;
    pthread_mutex_lock(&g_layers_mu);
    for (size_t i = 0; i < g_nlayers; i++) {
        if (strcmp(g_layers[i]->hex, hex) == 0) {
            *out = g_layers[i];
            pthread_mutex_unlock(&g_layers_mu);
            return 0;
        }
    }
    if (g_nlayers == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 64;
        struct layer **n = realloc(g_layers, cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&g_layers_mu); return -ENOMEM; }
        g_layers = n;
        g_cap = cap;
    }
    struct layer *l = calloc(1, sizeof *l);
    if (!l) { pthread_mutex_unlock(&g_layers_mu); return -ENOMEM; }
    memcpy(l->hex, hex, 64);
    l->ino = FIRST_LAYER_INO + g_nlayers;
    l->size = size;
    l->chunk = chunk;
    l->nchunks = nchunks;
    l->data_fd = l->present_fd = l->src_fd = -1;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    g_layers[g_nlayers++] = l;
    *out = l;
    pthread_mutex_unlock(&g_layers_mu);
    return 0;
}

static void layer_unload(struct layer *l) {
    free(l->digests);
    free(l->state);
    l->digests = NULL;
    l->state = NULL;
    if (l->data_fd >= 0) close(l->data_fd);
    if (l->present_fd >= 0) close(l->present_fd);
    if (l->src_fd >= 0) close(l->src_fd);
    l->data_fd = l->present_fd = l->src_fd = -1;
}

/* First open: load digests and cache state from disk (again after the last release, so
 * a cache the platform evicted meanwhile is never trusted). Called with l->mu held. */
static int layer_load(struct layer *l) {
    char path[4096];
    uint64_t size, nchunks;
    uint32_t chunk;
    int rc = read_header(l->hex, &size, &chunk, &nchunks);
    if (rc) return rc;
    if (size != l->size || chunk != l->chunk) return -EIO;
    l->digests = malloc(nchunks * 32 + 1);
    l->state = calloc(nchunks + 1, 1);
    if (!l->digests || !l->state) { layer_unload(l); return -ENOMEM; }
    snprintf(path, sizeof path, "%s/%s/index", g_cache, l->hex);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) { layer_unload(l); return -EIO; }
    ssize_t n = pread(fd, l->digests, nchunks * 32, INDEX_HEADER);
    close(fd);
    if (n != (ssize_t)(nchunks * 32)) { layer_unload(l); return -EIO; }
    snprintf(path, sizeof path, "%s/%s/data", g_cache, l->hex);
    l->data_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    snprintf(path, sizeof path, "%s/%s/present", g_cache, l->hex);
    l->present_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (l->data_fd < 0 || l->present_fd < 0) {
        logmsg("dsec-lazyfs: cannot open the cache of %s: %s", l->hex, strerror(errno));
        layer_unload(l);
        return -EIO;
    }
    struct stat st;
    if (fstat(l->data_fd, &st) == 0 && (uint64_t)st.st_size != size &&
        ftruncate(l->data_fd, (off_t)size) != 0) {
        layer_unload(l);
        return -EIO;
    }
    l->spec_unread = l->demand_chunks = 0;
    memset(l->ra_next, 0, sizeof l->ra_next);
    memset(l->ra_win, 0, sizeof l->ra_win);
    ssize_t got = pread(l->present_fd, l->state, nchunks, 0);
    for (ssize_t i = 0; i < got; i++) l->state[i] = l->state[i] == 1 ? ONDISK : ABSENT;
    if (!g_http) {
        snprintf(path, sizeof path, "%s/blobs/sha256/%s", g_store, l->hex);
        l->src_fd = open(path, O_RDONLY | O_CLOEXEC);
        if (l->src_fd < 0)
            logmsg("dsec-lazyfs: store blob %s: %s (reads of missing chunks fail)", path,
                   strerror(errno));
    }
    return 0;
}

/* ---------------------------------------------------------------- fetching */

struct worker {
    int sock; /* keep-alive connection to the HTTP store, -1 if none */
    SSL *ssl; /* its TLS session (https:// stores), else NULL */
    unsigned char *buf;
    size_t cap;
    char hdr[8192];
};

static void set_timeouts(int fd) {
    struct timeval tv = {.tv_sec = g_timeout, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int tcp_connect(void) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res, *ai;
    if (getaddrinfo(g_host, g_port, &hints, &res) != 0) return -1;
    int fd = -1;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int err = 0;
            socklen_t len = sizeof err;
            if (poll(&p, 1, g_timeout * 1000) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0)
                rc = 0;
        }
        if (rc == 0) {
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            set_timeouts(fd);
            break;
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void conn_close(struct worker *w) {
    if (w->ssl) SSL_free(w->ssl); /* no close_notify: the peer copes with a plain close */
    w->ssl = NULL;
    if (w->sock >= 0) close(w->sock);
    w->sock = -1;
}

/* A TCP connection, and over https:// a verified TLS session on it. 0 or -1 (logged). */
static int conn_open(struct worker *w) {
    w->sock = tcp_connect();
    if (w->sock < 0) {
        logmsg("dsec-lazyfs: cannot connect to the layer store %s:%s: %s", g_host, g_port,
               strerror(errno));
        return -1;
    }
    if (!g_tls) return 0;
    w->ssl = SSL_new(g_ssl_ctx);
    if (!w->ssl || SSL_set_fd(w->ssl, w->sock) != 1) goto fail;
    /* The certificate must name the host we dialled: an IP address is matched against
     * the IP SANs, a name against the DNS names (and sent as SNI). */
    if (g_host_is_ip) {
        if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(w->ssl), g_host) != 1) goto fail;
    } else if (SSL_set_tlsext_host_name(w->ssl, g_host) != 1 || SSL_set1_host(w->ssl, g_host) != 1) {
        goto fail;
    }
    if (SSL_connect(w->ssl) != 1) {
        long v = SSL_get_verify_result(w->ssl);
        unsigned long e = ERR_peek_last_error();
        if (v != X509_V_OK)
            logmsg("dsec-lazyfs: TLS handshake with the layer store %s:%s failed: its certificate "
                   "is not trusted (%s; CAs: %s)", g_host, g_port, X509_verify_cert_error_string(v),
                   g_ca_file ? g_ca_file : "the system store");
        else
            logmsg("dsec-lazyfs: TLS handshake with the layer store %s:%s failed: %s", g_host,
                   g_port, e ? ERR_reason_error_string(e) : "connection closed");
        ERR_clear_error();
        conn_close(w);
        return -1;
    }
    return 0;
fail:
    logmsg("dsec-lazyfs: cannot set up TLS for %s:%s", g_host, g_port);
    ERR_clear_error();
    conn_close(w);
    return -1;
}

static int conn_write_all(struct worker *w, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t wr;
        if (w->ssl) {
            int r = SSL_write(w->ssl, c, n > INT32_MAX ? INT32_MAX : (int)n);
            wr = r > 0 ? r : -1;
            if (r <= 0) ERR_clear_error();
        } else {
            wr = send(w->sock, c, n, MSG_NOSIGNAL);
            if (wr < 0 && errno == EINTR) continue;
        }
        if (wr <= 0) return -1;
        c += wr;
        n -= (size_t)wr;
    }
    return 0;
}

/* recv(2) or SSL_read: > 0 bytes, 0 at end of stream, -1 on error (EINTR retried). */
static ssize_t conn_read(struct worker *w, void *p, size_t n) {
    for (;;) {
        if (w->ssl) {
            int r = SSL_read(w->ssl, p, n > INT32_MAX ? INT32_MAX : (int)n);
            if (r > 0) return r;
            int e = SSL_get_error(w->ssl, r);
            ERR_clear_error();
            if (e == SSL_ERROR_ZERO_RETURN) return 0;
            if (e == SSL_ERROR_SYSCALL && errno == EINTR) continue;
            return -1;
        }
        ssize_t r = recv(w->sock, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        return r;
    }
}

/* (Re)load the Authorization header from the credentials file: at start, and when the
 * store answers 401 (the platform renews an expiring token by replacing the file).
 * 0, or -1 with g_auth unchanged. */
static int load_auth(int quiet) {
    char buf[sizeof g_auth];
    size_t off = g_cred_bearer ? (size_t)snprintf(buf, sizeof buf, "Bearer ") : 0;
    int fd = open(g_cred_file, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf + off, sizeof buf - 1 - off) : -1;
    if (fd >= 0) close(fd);
    if (n < 0) {
        if (!quiet) logmsg("dsec-lazyfs: cannot read %s: %s", g_cred_file, strerror(errno));
        return -1;
    }
    if ((size_t)n >= sizeof buf - 1 - off) {
        if (!quiet)
            logmsg("dsec-lazyfs: %s is too long (at most %zu bytes)", g_cred_file,
                   sizeof buf - 2 - off);
        return -1;
    }
    buf[off + (size_t)n] = 0;
    buf[strcspn(buf, "\r\n")] = 0;
    if (buf[off] == 0) buf[0] = 0;
    pthread_mutex_lock(&g_auth_mu);
    memcpy(g_auth, buf, sizeof g_auth);
    pthread_mutex_unlock(&g_auth_mu);
    return 0;
}

/* One GET with a Range header on the worker's keep-alive connection. Returns 0 with
 * exactly len bytes in out, or -1 (message logged once per failure; *status is the
 * HTTP status when the store answered one, else 0). */
static int http_range(struct worker *w, const char *hex, uint64_t off, size_t len,
                      unsigned char *out, int *retryable, int *status_out) {
    *retryable = 0;
    *status_out = 0;
    if (w->sock < 0) {
        if (conn_open(w) != 0) return -1;
    } else {
        *retryable = 1; /* a reused connection may have been closed by the server */
    }
    char req[6144];
    pthread_mutex_lock(&g_auth_mu);
    int n = snprintf(req, sizeof req,
                     "GET %s%ssha256:%s HTTP/1.1\r\nHost: %s:%s\r\n"
                     "Range: bytes=%llu-%llu\r\n%s%s%s"
                     "User-Agent: dsec-lazyfs\r\n\r\n",
                     g_prefix, g_blob_prefix, hex, g_host, g_port, (unsigned long long)off,
                     (unsigned long long)(off + len - 1), g_auth[0] ? "Authorization: " : "",
                     g_auth, g_auth[0] ? "\r\n" : "");
    pthread_mutex_unlock(&g_auth_mu);
    if (n < 0 || (size_t)n >= sizeof req) {
        logmsg("dsec-lazyfs: request for %s does not fit (auth header too long?)", hex);
        return -1;
    }
    errno = 0;
    if (conn_write_all(w, req, (size_t)n) != 0) goto broken;
    size_t have = 0;
    char *end = NULL;
    while (!end) {
        if (have == sizeof w->hdr - 1) goto broken;
        ssize_t r = conn_read(w, w->hdr + have, sizeof w->hdr - 1 - have);
        if (r <= 0) goto broken;
        have += (size_t)r;
        w->hdr[have] = 0;
        end = strstr(w->hdr, "\r\n\r\n");
    }
    *retryable = 0;
    size_t head = (size_t)(end - w->hdr) + 4;
    int status = 0;
    if (sscanf(w->hdr, "HTTP/1.%*c %d", &status) != 1) goto broken;
    long long clen = -1;
    int close_after = 0;
    for (char *line = strstr(w->hdr, "\r\n"); line && line < end; line = strstr(line + 2, "\r\n")) {
        char *l = line + 2;
        if (strncasecmp(l, "Content-Length:", 15) == 0) clen = atoll(l + 15);
        else if (strncasecmp(l, "Connection:", 11) == 0 && strstr(l, "close") && strstr(l, "close") < strstr(l, "\r\n"))
            close_after = 1;
    }
    if (clen < 0) goto broken;
    /* Body: whatever came with the headers, then the rest. */
    size_t extra = have - head;
    unsigned char sink[4096];
    int ok = (status == 206 || (status == 200 && off == 0)) && (size_t)clen == len;
    size_t got = 0;
    while (got < (size_t)clen) {
        unsigned char *dst = ok ? out + got : sink;
        size_t want = ok ? (size_t)clen - got : ((size_t)clen - got < sizeof sink ? (size_t)clen - got : sizeof sink);
        if (extra) {
            size_t take = extra < want ? extra : want;
            memcpy(dst, w->hdr + head, take);
            head += take;
            extra -= take;
            got += take;
            continue;
        }
        ssize_t r = conn_read(w, dst, want);
        if (r <= 0) goto broken;
        got += (size_t)r;
    }
    if (close_after) conn_close(w);
    *status_out = status;
    if (!ok) {
        if (status != 401) /* the caller re-reads the credentials and says so */
            logmsg("dsec-lazyfs: layer store answered HTTP %d (%lld bytes) for %s range %llu+%zu",
                   status, clen, hex, (unsigned long long)off, len);
        return -1;
    }
    return 0;
broken:
    if (!*retryable)
        logmsg("dsec-lazyfs: layer store connection failed for %s: %s", hex,
               errno ? strerror(errno) : "malformed response");
    conn_close(w);
    return -1;
}

static int fetch(struct worker *w, struct layer *l, uint64_t off, size_t len, unsigned char *out) {
    atomic_fetch_add(&st_fetch_reqs, 1);
    int rc;
    if (g_http) {
        int retryable, status;
        rc = http_range(w, l->hex, off, len, out, &retryable, &status);
        if (rc && retryable) rc = http_range(w, l->hex, off, len, out, &retryable, &status);
        if (rc && status == 401) {
            /* An expired token: the platform has renewed the file meanwhile. */
            atomic_fetch_add(&st_auth_reloads, 1);
            if (g_cred_file && load_auth(0) == 0)
                rc = http_range(w, l->hex, off, len, out, &retryable, &status);
            if (rc && status == 401)
                logmsg("dsec-lazyfs: the layer store refused the credentials (HTTP 401) for %s",
                       l->hex);
        }
    } else {
        ssize_t n = l->src_fd >= 0 ? pread(l->src_fd, out, len, (off_t)off) : -1;
        rc = n == (ssize_t)len ? 0 : -1;
        if (rc) logmsg("dsec-lazyfs: short read of store blob %s at %llu", l->hex, (unsigned long long)off);
    }
    if (rc) atomic_fetch_add(&st_fetch_errors, 1);
    else {
        atomic_fetch_add(&st_fetch_bytes, len);
        atomic_fetch_add(&l->fetched, len);
    }
    return rc;
}

static size_t chunk_len(struct layer *l, uint64_t c) {
    uint64_t start = c * l->chunk;
    return (size_t)(l->size - start < l->chunk ? l->size - start : l->chunk);
}

static int chunk_ok(struct layer *l, uint64_t c, const unsigned char *data) {
    unsigned char md[32];
    sha256(data, chunk_len(l, c), md);
    return memcmp(md, l->digests + c * 32, 32) == 0;
}

static int ensure_buf(struct worker *w, size_t need) {
    if (w->cap >= need) return 0;
    unsigned char *b = realloc(w->buf, need);
    if (!b) return -1;
    w->buf = b;
    w->cap = need;
    return 0;
}

/* Store chunks [first, first+count) of buf in the cache after checking each digest.
 * result[i] = READY or ABSENT. */
static void store_chunks(struct layer *l, uint64_t first, uint64_t count, const unsigned char *buf,
                         uint8_t *result) {
    size_t pos = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t c = first + i;
        size_t n = chunk_len(l, c);
        if (!chunk_ok(l, c, buf + pos)) {
            atomic_fetch_add(&st_verify_failures, 1);
            logmsg("dsec-lazyfs: chunk %llu of %s does not match its digest; not served",
                   (unsigned long long)c, l->hex);
            result[i] = ABSENT;
        } else if (pwrite(l->data_fd, buf + pos, n, (off_t)(c * l->chunk)) != (ssize_t)n) {
            logmsg("dsec-lazyfs: cannot write the cache of %s: %s", l->hex, strerror(errno));
            result[i] = ABSENT;
        } else {
            uint8_t one = 1;
            if (pwrite(l->present_fd, &one, 1, (off_t)c) != 1) { /* only a hint */ }
            atomic_fetch_add(&st_cache_write_bytes, n);
            atomic_fetch_add(&st_chunks_fetched, 1);
            result[i] = READY;
        }
        pos += n;
    }
}

/* Make chunks [c0, c1] READY. Claims the ones nobody handles, loads them (cache or
 * store, verified), then waits for the ones other threads claimed. 0 or -EIO. */
static int ensure_chunks(struct worker *w, struct layer *l, uint64_t c0, uint64_t c1) {
    uint64_t n = c1 - c0 + 1;
    uint8_t mine[MAX_READ / 4096 + 4 + RA_CHUNKS];
    uint8_t result[MAX_READ / 4096 + 4 + RA_CHUNKS];
    if (n > MAX_READ / 4096 + 4) return -EIO;
    for (int pass = 0; pass < 2; pass++) {
        int claimed = 0;
        uint64_t total = n; /* n asked for, then readahead chunks */
        pthread_mutex_lock(&l->mu);
        if (!l->state) { pthread_mutex_unlock(&l->mu); return -EIO; }
        for (uint64_t i = 0; i < n; i++) {
            uint8_t s = l->state[c0 + i];
            mine[i] = 0;
            if (s == ABSENT || s == ONDISK) {
                mine[i] = s == ONDISK ? 2 : 1;
                l->state[c0 + i] = BUSY;
                claimed = 1;
                l->demand_chunks++;
            } else if (s == READY_SPEC) {
                l->state[c0 + i] = READY;
                if (l->spec_unread) l->spec_unread--;
                atomic_fetch_add(&st_ra_used, 1);
            }
        }
        if (mine[n - 1] == 1) {
            unsigned k = 0;
            while (k < RA_STREAMS && !(l->ra_next[k] >= c0 && l->ra_next[k] <= c1 + 1 &&
                                       l->ra_next[k] > 0))
                k++;
            uint32_t win = 0;
            if (k == RA_STREAMS) {
                k = l->ra_rr++ % RA_STREAMS; /* a new stream replaces the oldest */
            } else {
                win = l->ra_win[k] ? l->ra_win[k] * 2 : RA_FIRST;
                if (win > RA_CHUNKS) win = RA_CHUNKS;
            }
            if (l->spec_unread > RA_SLACK + l->demand_chunks / RA_WASTE_DIV) win = 0;
            while (total < n + win && c0 + total < l->nchunks && l->state[c0 + total] == ABSENT) {
                l->state[c0 + total] = BUSY;
                mine[total++] = 1;
            }
            l->ra_next[k] = c0 + total;
            l->ra_win[k] = win;
        }
        pthread_mutex_unlock(&l->mu);
        if (claimed) {
            /* Chunks stored by an earlier run: verify them from disk once. */
            for (uint64_t i = 0; i < total; i++) {
                if (mine[i] != 2) continue;
                uint64_t c = c0 + i;
                size_t len = chunk_len(l, c);
                result[i] = ABSENT;
                if (ensure_buf(w, len) == 0 &&
                    pread(l->data_fd, w->buf, len, (off_t)(c * l->chunk)) == (ssize_t)len &&
                    chunk_ok(l, c, w->buf)) {
                    atomic_fetch_add(&st_chunks_verified_disk, 1);
                    result[i] = READY;
                } else {
                    mine[i] = 1; /* damaged or lost: fetch it again */
                }
            }
            /* Missing chunks: one range request per contiguous run. */
            for (uint64_t i = 0; i < total;) {
                if (mine[i] != 1) { i++; continue; }
                uint64_t j = i;
                while (j < total && mine[j] == 1) j++;
                uint64_t first = c0 + i, count = j - i;
                uint64_t off = first * l->chunk;
                size_t len = (size_t)((first + count) * l->chunk > l->size ? l->size - off
                                                                          : count * l->chunk);
                if (ensure_buf(w, len) == 0 && fetch(w, l, off, len, w->buf) == 0)
                    store_chunks(l, first, count, w->buf, result + i);
                else
                    memset(result + i, ABSENT, count);
                i = j;
            }
            pthread_mutex_lock(&l->mu);
            for (uint64_t i = 0; i < total; i++) {
                if (!mine[i] || !l->state) continue;
                if (i >= n && result[i] == READY) {
                    result[i] = READY_SPEC;
                    l->spec_unread++;
                    atomic_fetch_add(&st_ra_chunks, 1);
                }
                l->state[c0 + i] = result[i];
            }
            pthread_cond_broadcast(&l->cv);
            pthread_mutex_unlock(&l->mu);
        }
        int ready = 1, waited = 0;
        pthread_mutex_lock(&l->mu);
        for (uint64_t i = 0; i < n; i++) {
            while (l->state && l->state[c0 + i] == BUSY) {
                waited = 1;
                pthread_cond_wait(&l->cv, &l->mu);
            }
            if (!l->state || l->state[c0 + i] < READY) ready = 0;
        }
        pthread_mutex_unlock(&l->mu);
        if (waited) atomic_fetch_add(&st_waits, 1);
        if (ready) return 0;
        if (claimed) return -EIO; /* our own fetch failed: do not hammer the store */
    }
    return -EIO;
}

/* ---------------------------------------------------------------- FUSE replies */

static void reply(uint64_t unique, int error, const void *data, size_t len) {
    struct fuse_out_header h = {.len = (uint32_t)(sizeof h + (error ? 0 : len)),
                                .error = error,
                                .unique = unique};
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)data, error ? 0 : len}};
    ssize_t w = writev(g_fuse, iov, error || !len ? 1 : 2);
    if (w < 0 && errno != ENOENT) /* ENOENT: the request was interrupted */
        logmsg("dsec-lazyfs: reply failed: %s", strerror(errno));
}

static void fill_attr(struct fuse_attr *a, uint64_t ino) {
    memset(a, 0, sizeof *a);
    a->ino = ino;
    a->nlink = 1;
    a->blksize = 4096;
    if (ino == FUSE_ROOT_ID) {
        a->mode = S_IFDIR | 0555;
        a->nlink = 2;
    } else if (ino == STATS_INO) {
        a->mode = S_IFREG | 0444;
        a->size = 4096;
    } else {
        struct layer *l = layer_by_ino(ino);
        a->mode = S_IFREG | 0444;
        a->size = l ? l->size : 0;
    }
    a->blocks = (a->size + 511) / 512;
}

static int stats_text(char *buf, size_t cap) {
    int n = snprintf(buf, cap,
                     "read_requests %llu\nread_bytes %llu\nfetch_requests %llu\nfetch_bytes %llu\n"
                     "fetch_errors %llu\nchunks_fetched %llu\nchunks_verified_from_cache %llu\n"
                     "verify_failures %llu\nwaits %llu\ncache_write_bytes %llu\n"
                     "readahead_chunks %llu\nreadahead_chunks_used %llu\nauth_reloads %llu\n",
                     (unsigned long long)st_read_reqs, (unsigned long long)st_read_bytes,
                     (unsigned long long)st_fetch_reqs, (unsigned long long)st_fetch_bytes,
                     (unsigned long long)st_fetch_errors, (unsigned long long)st_chunks_fetched,
                     (unsigned long long)st_chunks_verified_disk,
                     (unsigned long long)st_verify_failures, (unsigned long long)st_waits,
                     (unsigned long long)st_cache_write_bytes, (unsigned long long)st_ra_chunks,
                     (unsigned long long)st_ra_used, (unsigned long long)st_auth_reloads);
    pthread_mutex_lock(&g_layers_mu);
    for (size_t i = 0; i < g_nlayers && n < (int)cap - 100; i++)
        n += snprintf(buf + n, cap - (size_t)n, "layer %s fetched %llu opens %d\n", g_layers[i]->hex,
                      (unsigned long long)g_layers[i]->fetched, g_layers[i]->opens);
    pthread_mutex_unlock(&g_layers_mu);
    return n < (int)cap ? n : (int)cap - 1;
}

static void do_read(struct worker *w, struct fuse_in_header *in, struct fuse_read_in *r) {
    if (in->nodeid == STATS_INO) {
        char buf[65536];
        int n = stats_text(buf, sizeof buf);
        size_t off = r->offset < (uint64_t)n ? (size_t)r->offset : (size_t)n;
        size_t len = (size_t)n - off < r->size ? (size_t)n - off : r->size;
        reply(in->unique, 0, buf + off, len);
        return;
    }
    struct layer *l = layer_by_ino(in->nodeid);
    if (!l) { reply(in->unique, -ENOENT, NULL, 0); return; }
    if (r->offset >= l->size || r->size == 0) { reply(in->unique, 0, NULL, 0); return; }
    size_t len = r->size > MAX_READ ? MAX_READ : r->size;
    if (r->offset + len > l->size) len = (size_t)(l->size - r->offset);
    atomic_fetch_add(&st_read_reqs, 1);
    int rc = ensure_chunks(w, l, r->offset / l->chunk, (r->offset + len - 1) / l->chunk);
    if (rc) { reply(in->unique, rc, NULL, 0); return; }
    static __thread unsigned char *out;
    if (!out) out = malloc(MAX_READ);
    if (!out) { reply(in->unique, -ENOMEM, NULL, 0); return; }
    ssize_t got = pread(l->data_fd, out, len, (off_t)r->offset);
    if (got != (ssize_t)len) { reply(in->unique, -EIO, NULL, 0); return; }
    atomic_fetch_add(&st_read_bytes, len);
    reply(in->unique, 0, out, len);
}

static void do_lookup(struct fuse_in_header *in, const char *name) {
    struct fuse_entry_out e;
    memset(&e, 0, sizeof e);
    if (in->nodeid != FUSE_ROOT_ID) { reply(in->unique, -ENOENT, NULL, 0); return; }
    if (strcmp(name, ".stats") == 0) {
        e.nodeid = STATS_INO;
    } else {
        struct layer *l;
        if (!is_hex64(name, strlen(name)) || layer_lookup(name, &l) != 0) {
            reply(in->unique, -ENOENT, NULL, 0); /* not cached as a negative entry */
            return;
        }
        e.nodeid = l->ino;
        e.entry_valid = ATTR_TTL;
        e.attr_valid = ATTR_TTL;
    }
    fill_attr(&e.attr, e.nodeid);
    reply(in->unique, 0, &e, sizeof e);
}

static void do_open(struct fuse_in_header *in, struct fuse_open_in *o) {
    struct fuse_open_out out = {0};
    if ((o->flags & O_ACCMODE) != O_RDONLY) { reply(in->unique, -EROFS, NULL, 0); return; }
    if (in->nodeid == STATS_INO) {
        out.open_flags = FOPEN_DIRECT_IO;
        reply(in->unique, 0, &out, sizeof out);
        return;
    }
    struct layer *l = layer_by_ino(in->nodeid);
    if (!l) { reply(in->unique, -ENOENT, NULL, 0); return; }
    pthread_mutex_lock(&l->mu);
    int rc = 0;
    if (l->opens == 0) rc = layer_load(l);
    if (rc == 0) l->opens++;
    pthread_mutex_unlock(&l->mu);
    if (rc) { reply(in->unique, rc, NULL, 0); return; }
    out.fh = l->ino;
    out.open_flags = FOPEN_KEEP_CACHE | (g_direct_io ? FOPEN_DIRECT_IO : 0);
    reply(in->unique, 0, &out, sizeof out);
}

static void do_release(struct fuse_in_header *in) {
    struct layer *l = layer_by_ino(in->nodeid);
    if (l) {
        pthread_mutex_lock(&l->mu);
        if (l->opens > 0 && --l->opens == 0) layer_unload(l);
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
    }
    reply(in->unique, 0, NULL, 0);
}

static void do_readdir(struct fuse_in_header *in, struct fuse_read_in *r) {
    char buf[65536];
    size_t n = 0, cap = r->size < sizeof buf ? r->size : sizeof buf;
    uint64_t idx = 0;
    const char *names[3] = {".", "..", ".stats"};
    uint64_t inos[3] = {FUSE_ROOT_ID, FUSE_ROOT_ID, STATS_INO};
    pthread_mutex_lock(&g_layers_mu);
    size_t total = 3 + g_nlayers;
    for (idx = r->offset; idx < total; idx++) {
        const char *name = idx < 3 ? names[idx] : g_layers[idx - 3]->hex;
        uint64_t ino = idx < 3 ? inos[idx] : g_layers[idx - 3]->ino;
        size_t namelen = strlen(name);
        size_t entlen = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET + namelen);
        if (n + entlen > cap) break;
        struct fuse_dirent *d = (struct fuse_dirent *)(buf + n);
        memset(d, 0, entlen);
        d->ino = ino;
        d->off = idx + 1;
        d->namelen = (uint32_t)namelen;
        d->type = idx < 2 ? DT_DIR : DT_REG;
        memcpy(d->name, name, namelen);
        n += entlen;
    }
    pthread_mutex_unlock(&g_layers_mu);
    reply(in->unique, 0, buf, n);
}

static void do_init(struct fuse_in_header *in, struct fuse_init_in *i) {
    struct fuse_init_out o;
    memset(&o, 0, sizeof o);
    o.major = FUSE_KERNEL_VERSION;
    o.minor = i->minor < FUSE_KERNEL_MINOR_VERSION ? i->minor : FUSE_KERNEL_MINOR_VERSION;
    if (i->major != FUSE_KERNEL_VERSION) { reply(in->unique, -EPROTO, NULL, 0); return; }
    o.max_readahead = g_readahead < i->max_readahead ? g_readahead : i->max_readahead;
    uint32_t want = FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_MAX_PAGES | FUSE_PARALLEL_DIROPS;
    o.flags = i->flags & want;
    o.max_background = 64;
    o.congestion_threshold = 48;
    o.max_write = 4096;
    o.time_gran = 1;
    o.max_pages = MAX_READ / 4096;
    reply(in->unique, 0, &o, sizeof o);
}

static void *worker_main(void *arg) {
    (void)arg;
    struct worker w = {.sock = -1};
    size_t bufsize = MAX_READ + 8192;
    char *buf = malloc(bufsize);
    if (!buf) return NULL;
    while (!g_stop) {
        ssize_t n = read(g_fuse, buf, bufsize);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT) continue;
            if (errno == ENODEV) { g_stop = 1; break; } /* unmounted */
            logmsg("dsec-lazyfs: read /dev/fuse: %s", strerror(errno));
            g_stop = 1;
            break;
        }
        if ((size_t)n < sizeof(struct fuse_in_header)) continue;
        struct fuse_in_header *in = (struct fuse_in_header *)buf;
        void *arg_ = buf + sizeof *in;
        switch (in->opcode) {
        case FUSE_INIT: do_init(in, arg_); break;
        case FUSE_LOOKUP: do_lookup(in, arg_); break;
        case FUSE_FORGET: case FUSE_BATCH_FORGET: break; /* no reply */
        case FUSE_GETATTR: {
            struct fuse_attr_out a;
            memset(&a, 0, sizeof a);
            if (in->nodeid >= FIRST_LAYER_INO && !layer_by_ino(in->nodeid)) {
                reply(in->unique, -ENOENT, NULL, 0);
                break;
            }
            fill_attr(&a.attr, in->nodeid);
            a.attr_valid = in->nodeid == STATS_INO ? 0 : ATTR_TTL;
            reply(in->unique, 0, &a, sizeof a);
            break;
        }
        case FUSE_OPEN: do_open(in, arg_); break;
        case FUSE_READ: do_read(&w, in, arg_); break;
        case FUSE_RELEASE: do_release(in); break;
        case FUSE_OPENDIR: {
            struct fuse_open_out o = {0};
            reply(in->unique, 0, &o, sizeof o);
            break;
        }
        case FUSE_READDIR: do_readdir(in, arg_); break;
        case FUSE_RELEASEDIR: case FUSE_FLUSH: reply(in->unique, 0, NULL, 0); break;
        case FUSE_STATFS: {
            struct fuse_statfs_out s;
            memset(&s, 0, sizeof s);
            s.st.bsize = 4096;
            s.st.frsize = 4096;
            s.st.namelen = 255;
            reply(in->unique, 0, &s, sizeof s);
            break;
        }
        case FUSE_INTERRUPT: break;
        case FUSE_DESTROY: reply(in->unique, 0, NULL, 0); g_stop = 1; break;
        default: reply(in->unique, -ENOSYS, NULL, 0); break;
        }
    }
    conn_close(&w);
    free(w.buf);
    free(buf);
    return NULL;
}

/* ---------------------------------------------------------------- setup */

static int parse_store(void) {
    const char *p = NULL, *defport = "80";
    if (strncmp(g_store, "http://", 7) == 0) p = g_store + 7;
    else if (strncmp(g_store, "https://", 8) == 0) { p = g_store + 8; defport = "443"; g_tls = 1; }
    if (p) {
        g_http = 1;
        const char *slash = strchr(p, '/');
        size_t hostlen = slash ? (size_t)(slash - p) : strlen(p);
        char hostport[300];
        if (hostlen == 0 || hostlen >= sizeof hostport) return -1;
        memcpy(hostport, p, hostlen);
        hostport[hostlen] = 0;
        snprintf(g_prefix, sizeof g_prefix, "%s", slash ? slash : "");
        size_t pl = strlen(g_prefix);
        while (pl && g_prefix[pl - 1] == '/') g_prefix[--pl] = 0;
        char *colon = strrchr(hostport, ':');
        if (hostport[0] == '[') { /* [v6]:port */
            char *close_ = strchr(hostport, ']');
            if (!close_) return -1;
            *close_ = 0;
            snprintf(g_host, sizeof g_host, "%s", hostport + 1);
            snprintf(g_port, sizeof g_port, "%s", close_[1] == ':' ? close_ + 2 : defport);
        } else if (colon) {
            *colon = 0;
            snprintf(g_host, sizeof g_host, "%s", hostport);
            snprintf(g_port, sizeof g_port, "%s", colon + 1);
        } else {
            snprintf(g_host, sizeof g_host, "%s", hostport);
            snprintf(g_port, sizeof g_port, "%s", defport);
        }
        unsigned char addr[16];
        g_host_is_ip = inet_pton(AF_INET, g_host, addr) == 1 || inet_pton(AF_INET6, g_host, addr) == 1;
        return 0;
    }
    if (g_store[0] == '/') return 0;
    return -1;
}

/* The TLS client context of an https:// store: TLS >= 1.2, the peer verified against
 * the system CA store or only --ca-file. 0, or -1 with the reason on stderr. */
static int tls_setup(void) {
    g_ssl_ctx = SSL_CTX_new(TLS_client_method());
    if (!g_ssl_ctx) return -1;
    SSL_CTX_set_min_proto_version(g_ssl_ctx, TLS1_2_VERSION);
    SSL_CTX_set_verify(g_ssl_ctx, SSL_VERIFY_PEER, NULL);
    SSL_CTX_set_mode(g_ssl_ctx, SSL_MODE_AUTO_RETRY);
    int ok = g_ca_file ? SSL_CTX_load_verify_locations(g_ssl_ctx, g_ca_file, NULL)
                       : SSL_CTX_set_default_verify_paths(g_ssl_ctx);
    if (ok != 1) {
        unsigned long e = ERR_get_error();
        fprintf(stderr, "dsec-lazyfs: cannot load the CA certificates %s: %s\n",
                g_ca_file ? g_ca_file : "(system store)", e ? ERR_reason_error_string(e) : "?");
        return -1;
    }
    return 0;
}

static void on_term(int sig) {
    (void)sig;
    g_stop = 1;
    if (g_mount) umount2(g_mount, MNT_DETACH); /* workers then see ENODEV */
}

static int usage(void) {
    fprintf(stderr, "usage: dsec-lazyfs --mount DIR --cache DIR --store URL|PATH [--token-file F]"
                    " [--auth-file F] [--ca-file PEM] [--blob-prefix /v1/blobs/]"
                    " [--threads N] [--timeout S] [--readahead BYTES] [--ready-fd FD] [--direct-io]"
                    " [--nice N]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *token_file = NULL, *auth_file = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--direct-io") == 0) { g_direct_io = 1; continue; }
        if (!v) return usage();
        if (strcmp(a, "--mount") == 0) g_mount = v;
        else if (strcmp(a, "--cache") == 0) g_cache = v;
        else if (strcmp(a, "--store") == 0) g_store = v;
        else if (strcmp(a, "--token-file") == 0) token_file = v;
        else if (strcmp(a, "--auth-file") == 0) auth_file = v;
        else if (strcmp(a, "--blob-prefix") == 0) g_blob_prefix = v;
        else if (strcmp(a, "--ca-file") == 0) g_ca_file = v;
        else if (strcmp(a, "--threads") == 0) g_threads = atoi(v);
        else if (strcmp(a, "--timeout") == 0) g_timeout = atoi(v);
        else if (strcmp(a, "--readahead") == 0) g_readahead = (unsigned)atoi(v);
        else if (strcmp(a, "--ready-fd") == 0) g_ready_fd = atoi(v);
        else if (strcmp(a, "--nice") == 0) g_nice = atoi(v);
        else return usage();
        i++;
    }
    if (!g_mount || !g_cache || !g_store || g_threads < 1 || g_threads > 256 || g_timeout < 1)
        return usage();
    if (parse_store() != 0) {
        fprintf(stderr, "dsec-lazyfs: --store must be http(s)://host:port[/prefix] or an absolute path\n");
        return 2;
    }
    if (g_tls && tls_setup() != 0) return 2;
    /* --token-file: a bearer token (dsec store serve); --auth-file: the whole header
     * value (an OCI registry's "Basic ..." or "Bearer ..."). */
    g_cred_file = auth_file ? auth_file : token_file;
    g_cred_bearer = !auth_file;
    if (g_cred_file && load_auth(1) != 0) {
        fprintf(stderr, "dsec-lazyfs: cannot read %s (or it is too long)\n", g_cred_file);
        return 2;
    }
    if (g_blob_prefix[0] != '/' || strlen(g_blob_prefix) > 256 || strpbrk(g_blob_prefix, " \r\n"))
        return usage();
    sha256_init_impl();
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    g_fuse = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (g_fuse < 0) { fprintf(stderr, "dsec-lazyfs: open /dev/fuse: %s\n", strerror(errno)); return 1; }
    char opts[256];
    snprintf(opts, sizeof opts,
             "fd=%d,rootmode=40555,user_id=0,group_id=0,allow_other,default_permissions,max_read=%u",
             g_fuse, MAX_READ);
    if (mount("dsec-lazyfs", g_mount, "fuse.dsec-lazyfs", MS_NOSUID | MS_NODEV | MS_RDONLY, opts) != 0) {
        fprintf(stderr, "dsec-lazyfs: mount %s: %s\n", g_mount, strerror(errno));
        return 1;
    }
    if (g_ready_fd >= 0) {
        char msg[64];
        int n = snprintf(msg, sizeof msg, "ready %d\n", (int)getpid());
        ssize_t w = write(g_ready_fd, msg, (size_t)n);
        (void)w;
        close(g_ready_fd);
    }
    logmsg("dsec-lazyfs: serving %s from %s (cache %s, %d threads, sha256 %s)", g_mount, g_store,
           g_cache, g_threads, g_sha256 ? "libcrypto" : "portable");
    /* Before the workers start: they inherit it. Best effort (needs CAP_SYS_NICE). */
    if (g_nice && setpriority(PRIO_PROCESS, 0, g_nice) != 0)
        logmsg("dsec-lazyfs: setpriority %d: %s", g_nice, strerror(errno));
    pthread_t *t = calloc((size_t)g_threads, sizeof *t);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < g_threads; i++) pthread_create(&t[i], &attr, worker_main, NULL);
    /* Every worker stops on ENODEV once the file system is unmounted (by the platform,
     * or by our SIGTERM handler). */
    for (int i = 0; i < g_threads; i++) pthread_join(t[i], NULL);
    logmsg("dsec-lazyfs: %s unmounted, exiting", g_mount);
    _exit(0);
}
