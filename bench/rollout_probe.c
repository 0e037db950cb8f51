/* Latency probe run inside an agent sandbox by bench/bench_rollouts.py: alternates POSTs
 * to two OpenAI-compatible endpoints (the model gateway and the trainer directly) and
 * prints "<label> <microseconds>" per call. HTTP/1.0, one connection per call. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static long call(const char *ip, int port, const char *token, const char *body) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) { close(fd); return -1; }
    char req[4096];
    int n = snprintf(req, sizeof req,
        "POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
        token, strlen(body), body);
    if (write(fd, req, n) != n) { close(fd); return -1; }
    char buf[65536], head[16] = {0};
    long got = 0, r;
    while ((r = read(fd, buf, sizeof buf)) > 0) {
        if (got < (long)sizeof head - 1)
            memcpy(head + got, buf, (size_t)(r < (long)sizeof head - 1 - got ? r : (long)sizeof head - 1 - got));
        got += r;
    }
    close(fd);
    clock_gettime(CLOCK_MONOTONIC, &b);
    /* a 2xx answer only: a refused or failed call is no latency sample */
    if (got < 12 || memcmp(head, "HTTP/1.", 7) != 0 || head[9] != '2') return -1;
    return (b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000;
}

int main(int argc, char **argv) {
    if (argc != 8) { fprintf(stderr, "usage: probe N gw_ip gw_port gw_token tr_ip tr_port tr_key\n"); return 2; }
    int n = atoi(argv[1]);
    const char *body = "{\"model\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"probe\"}]}";
    for (int i = 0; i < n; i++) {
        printf("gateway %ld\n", call(argv[2], atoi(argv[3]), argv[4], body));
        printf("direct %ld\n", call(argv[5], atoi(argv[6]), argv[7], body));
    }
    return 0;
}
