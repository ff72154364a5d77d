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
 * ports or read its log. Build: cc -O2 -shared -fPIC -o libarksteer.so steer.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define ARK_STEER_VERSION 2
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
static connect_fn real_connect_fn;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void resolve_real(void) { real_connect_fn = (connect_fn)dlsym(RTLD_NEXT, "connect"); }

static int real_connect(int fd, const struct sockaddr *addr, socklen_t len) {
    pthread_once(&once, resolve_real);
    if (!real_connect_fn) {
        errno = ENOSYS;
        return -1;
    }
    return real_connect_fn(fd, addr, len);
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

/* Bind fd to the rule's next free port of lane `lane` (-1: any lane); the port, or 0 when
 * none is free. Lock held. */
static uint16_t bind_next(struct ark_rule *r, int fd, int lane) {
    int start = lane >= 0 ? r->lane_next[lane] : r->next;
    for (int tried = 0; tried < r->n; tried++) {
        int i = (start + tried) % r->n;
        if (lane >= 0 && r->lanes[i] != lane) continue;
        struct sockaddr_in a;
        memset(&a, 0, sizeof(a));
        a.sin_family = AF_INET;
        a.sin_port = htons(r->ports[i]);
        if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
            r->next = (i + 1) % r->n;
            r->lane_next[r->lanes[i]] = r->next;
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
    if (getsockname(fd, (struct sockaddr *)&me, &ml) != 0 || me.sin_family != AF_INET) return 0;
    return me.sin_port == 0;
}

static uint16_t local_port(int fd) {
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    if (getsockname(fd, (struct sockaddr *)&me, &ml) != 0 || me.sin_family != AF_INET) return 0;
    return ntohs(me.sin_port);
}

/* The lane of the next steered connection (-1: the ports carry none). Lock held. */
static int turn_lane(const struct ark_rule *r) { return r->nlanes > 1 ? r->turn % r->nlanes : -1; }

/* Steer fd for rule r towards dport: a bound port, or 0 (fallback). */
static uint16_t steer_fd(struct ark_rule *r, int fd, uint16_t dport) {
    pthread_mutex_lock(&r->mu);
    int lane = turn_lane(r);
    uint16_t port = bind_next(r, fd, lane);
    for (int round = 0; !port && !r->exhausted && r->resolve && round < ARK_MAX_RESOLVES; round++) {
        int need = r->hint - r->steered;
        r->resolves++;
        r->exhausted = 1; /* until the resolver adds ports */
        pthread_mutex_unlock(&r->mu);
        int added = r->resolve(r->ctx, dport, need > 0 ? need : 1);
        pthread_mutex_lock(&r->mu);
        if (added <= 0) break;
        lane = turn_lane(r); /* the first ports may bring the lanes */
        port = bind_next(r, fd, lane);
    }
    if (!port && lane >= 0) port = bind_next(r, fd, -1); /* its lane is dry: any other */
    if (port) {
        r->steered++;
        r->turn++;
    } else {
        r->fallback++;
    }
    pthread_mutex_unlock(&r->mu);
    return port;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    struct ark_rule *r = current_rule;
    if (!r || !addr || len < (socklen_t)sizeof(struct sockaddr_in) || addr->sa_family != AF_INET)
        return real_connect(fd, addr, len);
    const struct sockaddr_in *to = (const struct sockaddr_in *)addr;
    uint16_t dport = ntohs(to->sin_port);
    if (to->sin_addr.s_addr != r->dst_ip || dport == r->skip_port || !unbound_tcp(fd))
        return real_connect(fd, addr, len);
    if (!r->steer) {
        int rc = real_connect(fd, addr, len);
        int saved = errno;
        pthread_mutex_lock(&r->mu);
        r->recorded++;
        log_conn(r, local_port(fd), dport, -1);
        pthread_mutex_unlock(&r->mu);
        errno = saved;
        return rc;
    }
    uint16_t port = steer_fd(r, fd, dport);
    int rc = real_connect(fd, addr, len);
    int saved = errno;
    pthread_mutex_lock(&r->mu);
    log_conn(r, port ? port : local_port(fd), dport, port ? 1 : 0);
    pthread_mutex_unlock(&r->mu);
    errno = saved;
    return rc;
}
