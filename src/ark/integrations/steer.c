/* ARK connect() interposer: binds the TCP connections a transfer engine opens itself to
 * source ports of a reserved path, without changing the engine.
 *
 * Loaded with LD_PRELOAD, it defines connect(). A connect() is steered only when the
 * calling thread has entered a rule (ark_steer_enter) whose peer address it targets, on
 * any destination port but the rule's skipped one (the engine's handshake port). Every
 * other connect() goes straight to the C library's: a thread without a rule pays one
 * thread-local load.
 *
 * A steered connect() binds the still unbound socket to the rule's next port that is free
 * (bind without SO_REUSEADDR, so a port held by any socket, in TIME_WAIT included, is
 * skipped and the engine's connect() can never meet a taken 4-tuple), then connects.
 * When the rule has no port left, it asks the rule's resolver (a callback, given the
 * destination port the engine connects to) for more, once per exhaustion; with none,
 * the connection goes out unbound (plain ECMP) and counts as a fallback.
 *
 * Ports may carry a lane (the part of a multi-path lease they belong to): connections
 * then take the lanes in turn (the k-th steered connection lane k mod lanes), each on the
 * lane's next free port (each lane keeps its own place), so that a port held by an earlier
 * connection moves a connection to another port of its own part, not to the next part's;
 * only when its lane has no free port left, even after the resolver, does it take a port
 * of another lane.
 *
 * Rules are heap objects: the owner thread enters and leaves one; any thread may add
 * ports or read its log.
 *
 * Process-wide rules (engines that keep their connections, e.g. UCX's TCP transport under
 * NIXL): ARK_STEER_RULES, read once when the library loads, names destinations and the
 * source ports of each: "IP[:DPORT]=ports:P,P,.../P,P,...[;...]", each '/'-separated group
 * a lane (the ports of one path), so that the connections to one destination take the
 * lanes in turn and one peer pair's connections sit on distinct paths; or
 * "IP[:DPORT]=lease:/PATH": each new connection asks the connection-lease holder at that
 * unix socket (ark.integrations.connlease) for the ports of a path leased for it alone,
 * and tells it the port it took; the holder keeps the lease while the kernel lists the
 * connection and releases it when it is gone (or idle). They apply to every
 * thread that has not entered a rule of its own. The variable is parsed all or nothing: any
 * error leaves no rule loaded and one line on stderr (ark_steer_env_error says it too).
 * An engine that binds its client socket to ifaddr:0 before connect() (UCX's
 * UCX_TCP_EP_BIND_SRC_ADDR=try, its default) would leave nothing to steer; while rules are
 * loaded, such a bind is deferred: recorded, answered 0, and applied at connect() with the
 * steered port (or port 0 when no rule matches), or at listen()/getsockname() unchanged.
 * ARK_STEER_DEFER=0 turns deferral off; ARK_STEER_LOG=FILE appends one line per connection
 * a process-wide rule saw ("dst_ip dport sport lane steered").
 *
 * Build: cc -O2 -shared -fPIC -o libarksteer.so steer.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define ARK_STEER_VERSION 3
#define ARK_MAX_PORTS 4096
#define ARK_MAX_LOG 4096
#define ARK_MAX_RESOLVES 8 /* resolver calls for one connection */

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);
/* Resolver: add ports for this destination port with ark_steer_add_ports; returns how many. */
typedef int (*resolve_fn)(void *ctx, uint16_t dport, int need);

struct ark_conn {
    uint16_t sport, dport;
    int32_t steered; /* 1 steered, 0 fallback (unbound), -1 not steered (recorded only) */
};

struct ark_rule {
    pthread_mutex_t mu;
    uint32_t dst_ip;    /* network order */
    uint16_t skip_port; /* host order; 0: none */
    int steer;          /* 0: record only */
    int hint;           /* connections the caller expects */
    resolve_fn resolve;
    void *ctx;
    uint16_t ports[ARK_MAX_PORTS];
    uint8_t lanes[ARK_MAX_PORTS];
    int n, next, exhausted;
    int nlanes, turn; /* lanes in use (1: none given), steered connections so far */
    int lane_next[256]; /* per lane, where its search for a free port starts */
    int steered, fallback, recorded, resolves;
    struct ark_conn log[ARK_MAX_LOG];
    int nlog;
};

static __thread struct ark_rule *current_rule;
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*listen_fn)(int, int);
typedef int (*getsockname_fn)(int, struct sockaddr *, socklen_t *);
static connect_fn real_connect_fn;
static bind_fn real_bind_fn;
static listen_fn real_listen_fn;
static getsockname_fn real_getsockname_fn;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void resolve_real(void) {
    real_connect_fn = (connect_fn)dlsym(RTLD_NEXT, "connect");
    real_bind_fn = (bind_fn)dlsym(RTLD_NEXT, "bind");
    real_listen_fn = (listen_fn)dlsym(RTLD_NEXT, "listen");
    real_getsockname_fn = (getsockname_fn)dlsym(RTLD_NEXT, "getsockname");
}

static int real_connect(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, resolve_real);
    if (!real_connect_fn) {
        errno = ENOSYS;
        return -1;
    }
    return real_connect_fn(fd, addr, len);
}

static int real_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, resolve_real);
    if (!real_bind_fn) {
        errno = ENOSYS;
        return -1;
    }
    return real_bind_fn(fd, addr, len);
}

static int real_getsockname(int fd, struct sockaddr *addr, socklen_t *len) {
    pthread_once(&once, resolve_real);
    if (!real_getsockname_fn) {
        errno = ENOSYS;
        return -1;
    }
    return real_getsockname_fn(fd, addr, len);
}

int ark_steer_version(void) { return ARK_STEER_VERSION; }

struct ark_rule *ark_steer_new(uint32_t dst_ip_be, int skip_port, int steer, int hint, resolve_fn resolve,
                               void *ctx) {
    struct ark_rule *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    r->dst_ip = dst_ip_be;
    r->skip_port = (uint16_t)skip_port;
    r->steer = steer;
    r->hint = hint > 0 ? hint : 1;
    r->resolve = resolve;
    r->ctx = ctx;
    r->nlanes = 1;
    return r;
}

void ark_steer_free(struct ark_rule *r) {
    if (!r) return;
    if (current_rule == r) current_rule = NULL;
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void ark_steer_enter(struct ark_rule *r) { current_rule = r; }

void ark_steer_leave(void) { current_rule = NULL; }

/* Append ports (host order, 1..65535) with their lanes (NULL: lane 0); returns how many
 * the rule took. */
int ark_steer_add_lanes(struct ark_rule *r, const uint16_t *ports, const uint8_t *lanes, int n) {
    int added = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < n && r->n < ARK_MAX_PORTS; i++) {
        if (ports[i] == 0) continue;
        uint8_t lane = lanes ? lanes[i] : 0;
        r->lanes[r->n] = lane;
        r->ports[r->n++] = ports[i];
        if (lane + 1 > r->nlanes) r->nlanes = lane + 1;
        added++;
    }
    if (added) r->exhausted = 0;
    pthread_mutex_unlock(&r->mu);
    return added;
}

int ark_steer_add_ports(struct ark_rule *r, const uint16_t *ports, int n) {
    return ark_steer_add_lanes(r, ports, NULL, n);
}

/* Replace the ports (a re-pathed lease): later connections use the new ones. */
void ark_steer_set_ports(struct ark_rule *r, const uint16_t *ports, int n) {
    pthread_mutex_lock(&r->mu);
    r->n = r->next = 0;
    r->nlanes = 1;
    memset(r->lane_next, 0, sizeof(r->lane_next));
    pthread_mutex_unlock(&r->mu);
    ark_steer_add_ports(r, ports, n);
}

/* stats: steered, fallback, recorded, resolves, ports held. */
void ark_steer_stats(struct ark_rule *r, int out[5]) {
    pthread_mutex_lock(&r->mu);
    out[0] = r->steered;
    out[1] = r->fallback;
    out[2] = r->recorded;
    out[3] = r->resolves;
    out[4] = r->n;
    pthread_mutex_unlock(&r->mu);
}

/* Copy up to max log entries as (sport, dport, steered) triples; returns the count. */
int ark_steer_log(struct ark_rule *r, int32_t *out, int max) {
    pthread_mutex_lock(&r->mu);
    int n = r->nlog < max ? r->nlog : max;
    for (int i = 0; i < n; i++) {
        out[3 * i] = r->log[i].sport;
        out[3 * i + 1] = r->log[i].dport;
        out[3 * i + 2] = r->log[i].steered;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

static void log_conn(struct ark_rule *r, uint16_t sport, uint16_t dport, int steered) {
    if (r->nlog < ARK_MAX_LOG) {
        r->log[r->nlog].sport = sport;
        r->log[r->nlog].dport = dport;
        r->log[r->nlog].steered = steered;
        r->nlog++;
    }
}

/* Bind fd to ip_be and the rule's next free port of lane `lane` (-1: any lane); the port
 * (its lane in *got_lane), or 0 when none is free. Lock held. */
static uint16_t bind_next(struct ark_rule *r, int fd, int lane, uint32_t ip_be, int *got_lane) {
    int start = lane >= 0 ? r->lane_next[lane] : r->next;
    for (int tried = 0; tried < r->n; tried++) {
        int i = (start + tried) % r->n;
        if (lane >= 0 && r->lanes[i] != lane) continue;
        struct sockaddr_in a;
        memset(&a, 0, sizeof(a));
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = ip_be;
        a.sin_port = htons(r->ports[i]);
        if (real_bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
            r->next = (i + 1) % r->n;
            r->lane_next[r->lanes[i]] = r->next;
            *got_lane = r->lanes[i];
            return r->ports[i];
        }
        if (errno != EADDRINUSE) return 0; /* not a port question: leave it to the kernel */
    }
    return 0;
}

static int unbound_tcp(int fd) {
    int type = 0;
    socklen_t tl = sizeof(type);
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) return 0;
    if (real_getsockname(fd, (struct sockaddr *)&me, &ml) != 0 || me.sin_family != AF_INET) return 0;
    return me.sin_port == 0;
}

static uint16_t local_port(int fd) {
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    if (real_getsockname(fd, (struct sockaddr *)&me, &ml) != 0 || me.sin_family != AF_INET) return 0;
    return ntohs(me.sin_port);
}

/* The lane of the next steered connection (-1: the ports carry none). Lock held. */
static int turn_lane(const struct ark_rule *r) { return r->nlanes > 1 ? r->turn % r->nlanes : -1; }

/* Steer fd for rule r towards dport, from ip_be: a bound port (its lane in *lane_out), or 0
 * (fallback). */
static uint16_t steer_fd(struct ark_rule *r, int fd, uint16_t dport, uint32_t ip_be, int *lane_out) {
    pthread_mutex_lock(&r->mu);
    int lane = turn_lane(r);
    uint16_t port = bind_next(r, fd, lane, ip_be, lane_out);
    for (int round = 0; !port && !r->exhausted && r->resolve && round < ARK_MAX_RESOLVES; round++) {
        int need = r->hint - r->steered;
        r->resolves++;
        r->exhausted = 1; /* until the resolver adds ports */
        pthread_mutex_unlock(&r->mu);
        int added = r->resolve(r->ctx, dport, need > 0 ? need : 1);
        pthread_mutex_lock(&r->mu);
        if (added <= 0) break;
        lane = turn_lane(r); /* the first ports may bring the lanes */
        port = bind_next(r, fd, lane, ip_be, lane_out);
    }
    if (!port && lane >= 0) port = bind_next(r, fd, -1, ip_be, lane_out); /* its lane is dry: any other */
    if (port) {
        r->steered++;
        r->turn++;
    } else {
        r->fallback++;
    }
    pthread_mutex_unlock(&r->mu);
    return port;
}

/* ------------------------------------------------------------------ process-wide rules */
#define ARK_ENV_MAX_RULES 64
#define ARK_ENV_MAX_LEN 65536
#define ARK_DEFER_FDS 65536 /* deferred binds are tracked for descriptors below this */

struct env_rule {
    struct ark_rule *rule; /* ports:... (NULL for lease:...) */
    uint32_t ip; /* network order */
    uint16_t dport; /* host order; 0: any */
    char lease[108]; /* lease:PATH: the connection-lease holder's unix socket */
    pthread_mutex_t mu; /* lease rules: counts */
    int asked, steered, fallback;
};

static struct env_rule env_rules[ARK_ENV_MAX_RULES];
static int env_n;
static char env_err[256];
static int env_log_fd = -1;

struct deferred {
    ino_t ino; /* the socket's inode: a reused descriptor is another socket */
    uint32_t ip; /* the address the engine bound, network order */
    uint8_t set;
};

static struct deferred *defer_tab; /* NULL: deferral off */
static pthread_mutex_t defer_mu = PTHREAD_MUTEX_INITIALIZER;
static int defer_count, defer_applied;

int ark_steer_env_rules(void) { return env_n; }

const char *ark_steer_env_error(void) { return env_err; }

struct ark_rule *ark_steer_env_rule(int i) { return i >= 0 && i < env_n ? env_rules[i].rule : NULL; }

/* deferred binds so far, and how many a connect() applied with a steered port */
void ark_steer_env_deferred(int out[2]) {
    pthread_mutex_lock(&defer_mu);
    out[0] = defer_count;
    out[1] = defer_applied;
    pthread_mutex_unlock(&defer_mu);
}

/* A decimal 1..max at *p ending at one of `ends` (or the string's end); 0 on error. */
static long parse_num(const char **p, long max, const char *ends) {
    const char *q = *p;
    long v = 0;
    if (*q < '0' || *q > '9') return 0;
    while (*q >= '0' && *q <= '9') {
        v = v * 10 + (*q++ - '0');
        if (v > max) return 0;
    }
    if (*q && !strchr(ends, *q)) return 0;
    *p = q;
    return v;
}

/* "IP[:DPORT]=ports:P,P/P,..." into e (its rule allocated); an error text, or NULL. */
static const char *parse_rule(const char *txt, struct env_rule *e) {
    char ip[16];
    const char *eq = strchr(txt, '='), *colon = strchr(txt, ':');
    if (!eq) return "expected IP[:DPORT]=ports:LIST";
    const char *ip_end = colon && colon < eq ? colon : eq;
    if (ip_end - txt <= 0 || ip_end - txt >= (long)sizeof(ip)) return "destination: expected an IPv4 address";
    memcpy(ip, txt, (size_t)(ip_end - txt));
    ip[ip_end - txt] = 0;
    struct in_addr a;
    if (inet_pton(AF_INET, ip, &a) != 1) return "destination: expected an IPv4 address";
    e->ip = a.s_addr;
    e->dport = 0;
    if (ip_end == colon) {
        const char *q = colon + 1;
        long d = parse_num(&q, 65535, "=");
        if (!d || q != eq) return "dport: expected 1..65535";
        e->dport = (uint16_t)d;
    }
    if (strncmp(eq + 1, "lease:", 6) == 0) {
        size_t n = strlen(eq + 7);
        if (eq[7] != '/' || n >= sizeof(e->lease)) return "lease: expected an absolute socket path under 108 characters";
        memcpy(e->lease, eq + 7, n + 1);
        pthread_mutex_init(&e->mu, NULL);
        return NULL;
    }
    if (strncmp(eq + 1, "ports:", 6) != 0) return "source: expected ports:LIST (ports of one path per '/' group) or lease:PATH";
    e->rule = ark_steer_new(e->ip, 0, 1, 1, NULL, NULL);
    if (!e->rule) return "out of memory";
    const char *q = eq + 7;
    int lane = 0;
    for (;;) {
        long port = parse_num(&q, 65535, ",/");
        if (!port) return "ports: expected 1..65535, ',' between ports and '/' between paths";
        uint16_t p16 = (uint16_t)port;
        uint8_t l8 = (uint8_t)lane;
        if (ark_steer_add_lanes(e->rule, &p16, &l8, 1) != 1) return "ports: at most 4096 per rule";
        if (!*q) return NULL;
        if (*q == '/' && ++lane > 255) return "ports: at most 256 paths per rule";
        q++;
    }
}

static void env_fail(int i, const char *rule, const char *why) {
    snprintf(env_err, sizeof(env_err), "ARK_STEER_RULES: rule %d (%.40s): %s", i + 1, rule, why);
    for (int k = 0; k < ARK_ENV_MAX_RULES; k++) {
        if (env_rules[k].rule) ark_steer_free(env_rules[k].rule);
        env_rules[k].rule = NULL;
    }
    env_n = 0;
    fprintf(stderr, "ark-steer: %s; no rule loaded\n", env_err);
}

/* Split the variable into rules; all or nothing. */
static void env_parse(const char *v) {
    static char buf[ARK_ENV_MAX_LEN];
    size_t len = strlen(v);
    if (len >= sizeof(buf)) {
        env_fail(0, "", "longer than 65535 characters");
        return;
    }
    memcpy(buf, v, len + 1);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ";", &save); tok; tok = strtok_r(NULL, ";", &save), n++) {
        if (n >= ARK_ENV_MAX_RULES) {
            env_fail(n, tok, "at most 64 rules");
            return;
        }
        const char *why = parse_rule(tok, &env_rules[n]);
        for (int k = 0; !why && k < n; k++)
            if (env_rules[k].ip == env_rules[n].ip && env_rules[k].dport == env_rules[n].dport)
                why = "a second rule for this destination";
        if (why) {
            env_fail(n, tok, why);
            return;
        }
        env_n = n + 1;
    }
    if (!n) env_fail(0, "", "no rule (unset the variable to steer nothing)");
}

__attribute__((constructor)) static void env_load(void) {
    const char *v = getenv("ARK_STEER_RULES");
    if (!v || !*v) return;
    const char *defer = getenv("ARK_STEER_DEFER");
    if (defer && strcmp(defer, "0") && strcmp(defer, "1")) {
        snprintf(env_err, sizeof(env_err), "ARK_STEER_DEFER: expected 0 or 1; got %.20s", defer);
        fprintf(stderr, "ark-steer: %s; no rule loaded\n", env_err);
        return;
    }
    env_parse(v);
    if (!env_n) return;
    const char *log = getenv("ARK_STEER_LOG");
    if (log && *log) env_log_fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (!defer || !strcmp(defer, "1")) defer_tab = calloc(ARK_DEFER_FDS, sizeof(*defer_tab));
}

static int bind_to(int fd, uint32_t ip_be, uint16_t port);

static struct env_rule *env_match(uint32_t ip, uint16_t dport) {
    struct env_rule *any = NULL;
    for (int i = 0; i < env_n; i++) {
        if (env_rules[i].ip != ip) continue;
        if (env_rules[i].dport == dport) return &env_rules[i];
        if (!env_rules[i].dport) any = &env_rules[i];
    }
    return any;
}

/* lease rules: connections asked for, steered onto a leased port, gone out on the engine's own */
void ark_steer_env_lease_stats(int i, int out[3]) {
    out[0] = out[1] = out[2] = 0;
    if (i < 0 || i >= env_n || !env_rules[i].lease[0]) return;
    pthread_mutex_lock(&env_rules[i].mu);
    out[0] = env_rules[i].asked;
    out[1] = env_rules[i].steered;
    out[2] = env_rules[i].fallback;
    pthread_mutex_unlock(&env_rules[i].mu);
}

#define ARK_LEASE_TIMEOUT_US 1000000 /* a holder that does not answer in 1 s: the engine's own port */
#define ARK_LEASE_MAX_PORTS 64

/* Ask e's holder for the ports of a path leased for this connection: how many (0: none, the
 * holder did not answer or refused); *sock: the open exchange, for lease_tell. */
static int lease_ask(const struct env_rule *e, const struct sockaddr_in *to, int *sock, uint16_t *ports) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return 0;
    struct timeval tv = {0, ARK_LEASE_TIMEOUT_US};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_un a;
    memset(&a, 0, sizeof(a));
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, e->lease, strlen(e->lease) + 1);
    char ip[16], buf[1024];
    inet_ntop(AF_INET, &to->sin_addr, ip, sizeof(ip));
    int n = snprintf(buf, sizeof(buf), "ask %s %u\n", ip, ntohs(to->sin_port));
    if (real_connect(s, (struct sockaddr *)&a, sizeof(a)) != 0 || send(s, buf, (size_t)n, MSG_NOSIGNAL) != n) {
        close(s);
        return 0;
    }
    size_t got = 0;
    while (got < sizeof(buf) - 1 && !memchr(buf, '\n', got)) {
        ssize_t r = read(s, buf + got, sizeof(buf) - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    buf[got] = 0;
    int count = 0;
    const char *q = buf + 6;
    if (strncmp(buf, "ports ", 6) == 0 && strchr(buf, '\n')) {
        for (long p; count < ARK_LEASE_MAX_PORTS && (p = parse_num(&q, 65535, ",\n")); q++) {
            ports[count++] = (uint16_t)p;
            if (*q == '\n') break;
        }
    }
    if (!count) {
        close(s);
        return 0;
    }
    *sock = s;
    return count;
}

/* Tell the holder which port the connection took (0: none was free), and end the exchange. */
static void lease_tell(int s, uint16_t port) {
    char line[32];
    int n = port ? snprintf(line, sizeof(line), "open %u\n", port) : snprintf(line, sizeof(line), "fail\n");
    if (send(s, line, (size_t)n, MSG_NOSIGNAL) < 0) { /* the holder releases a lease no connection took */ }
    close(s);
}

/* Bind fd to the first free leased port; the port, or 0. */
static uint16_t bind_leased(int fd, uint32_t ip_be, const uint16_t *ports, int n) {
    for (int i = 0; i < n; i++) {
        if (bind_to(fd, ip_be, ports[i]) == 0) return ports[i];
        if (errno != EADDRINUSE) return 0;
    }
    return 0;
}

static void env_log(const struct sockaddr_in *to, uint16_t sport, int lane, int steered) {
    if (env_log_fd < 0) return;
    char ip[16], line[96];
    inet_ntop(AF_INET, &to->sin_addr, ip, sizeof(ip));
    int n = snprintf(line, sizeof(line), "%s %u %u %d %d\n", ip, ntohs(to->sin_port), sport, lane, steered);
    if (n > 0 && write(env_log_fd, line, (size_t)n) < 0) { /* a log that cannot be written is dropped */ }
}

/* ------------------------------------------------------------------ deferred binds */
/* Take fd's deferred bind (its address in *ip_be); 1 when it had one. */
static int take_deferred(int fd, uint32_t *ip_be) {
    if (!defer_tab || fd < 0 || fd >= ARK_DEFER_FDS) return 0;
    struct stat st;
    int got = 0;
    pthread_mutex_lock(&defer_mu);
    struct deferred *d = &defer_tab[fd];
    if (d->set && fstat(fd, &st) == 0 && st.st_ino == d->ino) {
        *ip_be = d->ip;
        got = 1;
    }
    d->set = 0;
    pthread_mutex_unlock(&defer_mu);
    return got;
}

static int bind_to(int fd, uint32_t ip_be, uint16_t port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = ip_be;
    a.sin_port = htons(port);
    return real_bind(fd, (struct sockaddr *)&a, sizeof(a));
}

/* Apply fd's deferred bind as the engine asked it (port 0); -1 with errno when it fails. */
static int flush_deferred(int fd) {
    uint32_t ip;
    return take_deferred(fd, &ip) ? bind_to(fd, ip, 0) : 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (defer_tab && addr && len >= (socklen_t)sizeof(struct sockaddr_in) && addr->sa_family == AF_INET &&
        ((const struct sockaddr_in *)addr)->sin_port == 0 && fd >= 0 && fd < ARK_DEFER_FDS && unbound_tcp(fd)) {
        struct stat st;
        if (fstat(fd, &st) == 0) {
            pthread_mutex_lock(&defer_mu);
            defer_tab[fd] = (struct deferred){st.st_ino, ((const struct sockaddr_in *)addr)->sin_addr.s_addr, 1};
            defer_count++;
            pthread_mutex_unlock(&defer_mu);
            return 0;
        }
    }
    return real_bind(fd, addr, len);
}

int listen(int fd, int backlog) {
    if (flush_deferred(fd) != 0) return -1;
    pthread_once(&once, resolve_real);
    if (!real_listen_fn) {
        errno = ENOSYS;
        return -1;
    }
    return real_listen_fn(fd, backlog);
}

int getsockname(int fd, struct sockaddr *addr, socklen_t *len) {
    if (flush_deferred(fd) != 0) return -1;
    return real_getsockname(fd, addr, len);
}

/* ------------------------------------------------------------------ connect() */
static int record_only(struct ark_rule *r, int fd, const struct sockaddr *addr, socklen_t len, uint16_t dport) {
    int rc = real_connect(fd, addr, len);
    int saved = errno;
    pthread_mutex_lock(&r->mu);
    r->recorded++;
    log_conn(r, local_port(fd), dport, -1);
    pthread_mutex_unlock(&r->mu);
    errno = saved;
    return rc;
}

/* The rule for this connection: the thread's own when it targets it, else a process-wide one
 * (*env: its entry, whose rule is NULL for a lease rule). */
static struct ark_rule *rule_for(const struct sockaddr_in *to, uint16_t dport, struct env_rule **env) {
    struct ark_rule *r = current_rule;
    *env = NULL;
    if (r && to->sin_addr.s_addr == r->dst_ip && dport != r->skip_port) return r;
    *env = env_match(to->sin_addr.s_addr, dport);
    return *env ? (*env)->rule : NULL;
}

static void count_lease(struct env_rule *e, uint16_t port) {
    pthread_mutex_lock(&e->mu);
    e->asked++;
    if (port)
        e->steered++;
    else
        e->fallback++;
    pthread_mutex_unlock(&e->mu);
}

/* A connection under a lease rule: the holder's ports, or the engine's own bind. */
static int connect_leased(struct env_rule *e, int fd, const struct sockaddr_in *to, socklen_t len, int deferred,
                          uint32_t ip) {
    uint16_t ports[ARK_LEASE_MAX_PORTS], port = 0;
    int s = -1, n = lease_ask(e, to, &s, ports);
    if (n) {
        port = bind_leased(fd, ip, ports, n);
        lease_tell(s, port);
    }
    count_lease(e, port);
    if (!port && deferred && bind_to(fd, ip, 0) != 0) return -1;
    if (port && deferred) {
        pthread_mutex_lock(&defer_mu);
        defer_applied++;
        pthread_mutex_unlock(&defer_mu);
    }
    int rc = real_connect(fd, (const struct sockaddr *)to, len);
    int saved = errno;
    env_log(to, port ? port : local_port(fd), port ? 0 : -1, port ? 1 : 0);
    errno = saved;
    return rc;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    uint32_t ip = htonl(INADDR_ANY);
    int deferred = take_deferred(fd, &ip);
    struct env_rule *env = NULL;
    struct ark_rule *r = NULL;
    const struct sockaddr_in *to = (const struct sockaddr_in *)addr;
    uint16_t dport = 0;
    if (addr && len >= (socklen_t)sizeof(struct sockaddr_in) && addr->sa_family == AF_INET) {
        dport = ntohs(to->sin_port);
        r = rule_for(to, dport, &env);
    }
    int mine = deferred || ((r || env) && unbound_tcp(fd)); /* else the engine chose its port itself */
    if (env && !r && mine) return connect_leased(env, fd, to, len, deferred, ip);
    if (!mine) r = NULL;
    if (!r || !r->steer) {
        if (deferred && bind_to(fd, ip, 0) != 0) return -1;
        return r ? record_only(r, fd, addr, len, dport) : real_connect(fd, addr, len);
    }
    int lane = -1;
    uint16_t port = steer_fd(r, fd, dport, ip, &lane);
    if (!port && deferred && bind_to(fd, ip, 0) != 0) return -1; /* no free port: the engine's own bind */
    if (port && deferred) {
        pthread_mutex_lock(&defer_mu);
        defer_applied++;
        pthread_mutex_unlock(&defer_mu);
    }
    int rc = real_connect(fd, addr, len);
    int saved = errno;
    uint16_t sport = port ? port : local_port(fd);
    pthread_mutex_lock(&r->mu);
    log_conn(r, sport, dport, port ? 1 : 0);
    pthread_mutex_unlock(&r->mu);
    if (env) env_log(to, sport, port ? lane : -1, port ? 1 : 0);
    errno = saved;
    return rc;
}
