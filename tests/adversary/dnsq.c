/* A raw DNS client for the DNS attacks of tests/adversary/test_dns.py.
 *
 *   dnsq [-v] [-p PORT] SERVER QTYPE NAMES-FILE [REPEAT]
 *
 * Sends one query of type QTYPE (a number: 1 A, 16 TXT, 10 NULL, ...) per line of
 * NAMES-FILE ("-": stdin), REPEAT times over, each as fast as the previous reply (or a
 * 1 s timeout) allows, so a sandbox can flood its resolver without a process per query.
 * Labels are encoded as given, without any validation, and "\xHH" inserts a raw byte, so
 * names no resolver library would send (long or binary labels) can be tried. A line
 * "@HEX" sends those bytes as the whole datagram instead. Prints, with -v, one line per
 * query: "<name> <rcode> <address>..."; always a last line
 * "sent=N noerror=N refused=N servfail=N formerr=N other=N timeout=N answers=N".
 * With -p, every query leaves from source port PORT, as from a resolver that keeps its
 * socket (tests/test_network.py: such a flow across an edge restart).
 * Built static on the host by the tests and copied into the sandbox.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Encodes NAME into OUT as wire labels; returns the length or -1. */
static int encode_name(const char *name, unsigned char *out, int cap) {
    int pos = 0, lenpos = 0, len = 0;
    if (cap < 2) return -1;
    out[pos++] = 0;
    for (const char *p = name; *p; p++) {
        int byte = (unsigned char)*p;
        if (*p == '.') {
            out[lenpos] = (unsigned char)len;
            lenpos = pos++;
            len = 0;
            if (pos >= cap) return -1;
            out[lenpos] = 0;
            continue;
        }
        if (p[0] == '\\' && p[1] == 'x' && hexval(p[2]) >= 0 && hexval(p[3]) >= 0) {
            byte = hexval(p[2]) * 16 + hexval(p[3]);
            p += 3;
        }
        if (pos >= cap - 1) return -1;
        out[pos++] = (unsigned char)byte;
        len++;
    }
    out[lenpos] = (unsigned char)len;
    if (len > 0) out[pos++] = 0;
    return pos;
}

static int build(const char *line, int qtype, unsigned id, unsigned char *pkt, int cap) {
    if (line[0] == '@') {
        int n = 0;
        for (const char *p = line + 1; hexval(p[0]) >= 0 && hexval(p[1]) >= 0; p += 2) {
            if (n >= cap) return -1;
            pkt[n++] = (unsigned char)(hexval(p[0]) * 16 + hexval(p[1]));
        }
        return n;
    }
    memset(pkt, 0, 12);
    pkt[0] = id >> 8, pkt[1] = id & 0xff;
    pkt[2] = 0x01; /* RD */
    pkt[5] = 1;    /* one question */
    int n = encode_name(line, pkt + 12, cap - 16);
    if (n < 0) return -1;
    n += 12;
    pkt[n++] = (unsigned char)(qtype >> 8), pkt[n++] = (unsigned char)(qtype & 0xff);
    pkt[n++] = 0, pkt[n++] = 1; /* class IN */
    return n;
}

/* Skips a (possibly compressed) name; returns the new offset or -1. */
static int skip_name(const unsigned char *b, int len, int off) {
    while (off < len) {
        if ((b[off] & 0xc0) == 0xc0) return off + 2;
        if (b[off] == 0) return off + 1;
        off += b[off] + 1;
    }
    return -1;
}

int main(int argc, char **argv) {
    int verbose = 0, port = 0;
    for (;;) {
        if (argc > 1 && strcmp(argv[1], "-v") == 0) verbose = 1, argv++, argc--;
        else if (argc > 2 && strcmp(argv[1], "-p") == 0) port = atoi(argv[2]), argv += 2, argc -= 2;
        else break;
    }
    if (argc < 4) {
        fprintf(stderr, "usage: dnsq [-v] [-p PORT] SERVER QTYPE NAMES-FILE [REPEAT]\n");
        return 2;
    }
    int qtype = atoi(argv[2]);
    int repeat = argc > 4 ? atoi(argv[4]) : 1;
    FILE *in = strcmp(argv[3], "-") == 0 ? stdin : fopen(argv[3], "r");
    if (!in) { perror("open"); return 2; }
    char **lines = NULL;
    int nlines = 0;
    static char buf[70000];
    while (fgets(buf, sizeof buf, in)) {
        buf[strcspn(buf, "\n")] = 0;
        if (!buf[0]) continue;
        lines = realloc(lines, sizeof *lines * (nlines + 1));
        lines[nlines++] = strdup(buf);
    }
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(53)};
    if (fd < 0 || inet_pton(AF_INET, argv[1], &sa.sin_addr) != 1) { perror("socket"); return 2; }
    if (port) {
        int one = 1;
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port)};
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, (struct sockaddr *)&me, sizeof me) < 0) { perror("bind"); return 2; }
    }
    struct timeval tv = {.tv_sec = 1};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    long sent = 0, noerror = 0, refused = 0, servfail = 0, formerr = 0, other = 0, timeouts = 0,
         answers = 0;
    static unsigned char pkt[70000], reply[70000];
    unsigned id = (unsigned)getpid();
    for (int r = 0; r < repeat; r++) {
        for (int i = 0; i < nlines; i++) {
            id = (id * 1103515245u + 12345u) & 0xffff;
            int n = build(lines[i], qtype, id, pkt, sizeof pkt);
            if (n < 0) { fprintf(stderr, "cannot encode %s\n", lines[i]); return 2; }
            if (sendto(fd, pkt, n, 0, (struct sockaddr *)&sa, sizeof sa) < 0) { perror("send"); return 2; }
            sent++;
            int got = (int)recv(fd, reply, sizeof reply, 0);
            if (got < 12) {
                timeouts++;
                if (verbose) printf("%s timeout\n", lines[i]);
                continue;
            }
            int rcode = reply[3] & 0x0f, an = reply[6] << 8 | reply[7];
            if (rcode == 0) noerror++;
            else if (rcode == 5) refused++;
            else if (rcode == 2) servfail++;
            else if (rcode == 1) formerr++;
            else other++;
            if (verbose) printf("%s %d", lines[i], rcode);
            int off = skip_name(reply, got, 12);
            off = off < 0 ? got : off + 4;
            for (int a = 0; a < an && off >= 0 && off + 10 <= got; a++) {
                off = skip_name(reply, got, off);
                if (off < 0 || off + 10 > got) break;
                int type = reply[off] << 8 | reply[off + 1];
                int rdlen = reply[off + 8] << 8 | reply[off + 9];
                off += 10;
                if (type == 1 && rdlen == 4 && off + 4 <= got) {
                    answers++;
                    if (verbose)
                        printf(" %d.%d.%d.%d", reply[off], reply[off + 1], reply[off + 2], reply[off + 3]);
                }
                off += rdlen;
            }
            if (verbose) printf("\n");
        }
    }
    printf("sent=%ld noerror=%ld refused=%ld servfail=%ld formerr=%ld other=%ld timeout=%ld answers=%ld\n",
           sent, noerror, refused, servfail, formerr, other, timeouts, answers);
    return 0;
}
