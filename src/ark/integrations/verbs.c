/* ARK verbs interposer: puts the RoCEv2 queue pairs an unmodified RDMA engine connects on
 * the UDP source ports of reserved paths.
 *
 * Linux derives a RoCEv2 QP's UDP source port from the GRH flow label the QP is given when
 * it moves INIT -> RTR (rdma_get_udp_sport in include/rdma/ib_verbs.h). This library
 * defines ibv_modify_qp with libibverbs' own version (IBVERBS_1.1, by the version script
 * the build passes) so that it interposes the engine's calls: loaded with LD_PRELOAD for
 * engines that link libibverbs, or named by NCCL_IBVERBS_LIB for NCCL, which dlopen()s its
 * verbs library and dlvsym()s every function from that handle (this library lists
 * libibverbs.so.1 as a dependency, so every other symbol resolves to the real one).
 *
 * A call is steered only when it moves an RC or UC QP to RTR with an address vector that
 * has a GRH (attr_mask has IBV_QP_STATE and IBV_QP_AV, qp_state IBV_QPS_RTR, is_global),
 * towards a peer that a rule names (the GRH's destination GID; RoCEv2 over IPv4: the
 * IPv4-mapped ::ffff:a.b.c.d). The rule applies when the calling thread entered it
 * (ark_verbs_enter) or when it is installed for the whole process (ark_verbs_install, or
 * ARK_VERBS_RULES in the environment): engines set their QPs up on their own threads
 * (NCCL's proxy thread, Mooncake's transfer workers), which a caller's thread rule never
 * sees. The steered call goes on with a copy of the caller's attributes whose flow label
 * gives the rule's next port: QPs take the rule's lanes (parts of a multi-path lease) in
 * turn, each the next port of its lane. Every other call goes to the real ibv_modify_qp
 * untouched; a thread without a rule in a process without installed rules pays one
 * thread-local and one atomic load.
 *
 * Each rule logs its QPs (number, port, flow label, lane). ark_verbs_repath moves a live
 * steered QP to another port with mlx5dv_modify_qp_udp_sport (rdma-core 33+, mlx5 with the
 * rts2rts_qp_udp_sport capability, QP in RTS), looked up at run time: without it the call
 * says so and the QP keeps its path.
 *
 * Build: see ark.integrations.verbs (real <infiniband/verbs.h>, a version script, and
 * libibverbs.so.1 as a dependency).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ARK_VERBS_VERSION 1
#define ARK_MAX_PORTS 4096
#define ARK_MAX_LOG 4096
#define ARK_MAX_INSTALLED 64
#define ARK_SPORT_MIN 0xC000

/* ark_verbs_repath results besides 0 and the errno mlx5dv_modify_qp_udp_sport returns. */
#define ARK_NO_MLX5DV (-1)  /* mlx5dv_modify_qp_udp_sport is not in this process */
#define ARK_NO_QP (-2)      /* the rule steered no live QP with that number */
#define ARK_BAD_PORT (-3)

typedef int (*modify_fn)(struct ibv_qp *, struct ibv_qp_attr *, int);
typedef int (*destroy_fn)(struct ibv_qp *);
typedef int (*sport_fn)(struct ibv_qp *, uint16_t);

enum { KIND_RECORDED = -1, KIND_NO_PORT = 0, KIND_STEERED = 1 };

struct ark_qp_entry {
    struct ibv_qp *qp; /* NULL once the engine destroyed it: never used after */
    uint32_t qp_num, dest_qp_num, flow_label;
    uint16_t port; /* the port set (steered), or the one the kernel derives */
    int16_t lane;  /* -1: the rule's ports carry no lanes, or none was taken */
    int8_t kind;
    int8_t repathed;
};

struct ark_vrule {
    pthread_mutex_t mu;
    struct ark_vrule *next_rule; /* every live rule, for ibv_destroy_qp */
    int users;                   /* RTRs in flight with this rule (under rules_mu) */
    uint8_t gid[16];
    int steer; /* 0: record only (the port the kernel derives) */
    uint16_t ports[ARK_MAX_PORTS];
    uint8_t lanes[ARK_MAX_PORTS];
    int n, nlanes, turn, next;
    int lane_next[256];
    int steered, no_port, recorded, repaths;
    struct ark_qp_entry log[ARK_MAX_LOG];
    int nlog;
    int log_fd; /* >= 0: also append each QP as a JSON line (ARK_VERBS_LOG) */
};

static __thread struct ark_vrule *current_rule;
static atomic_int n_installed;
static struct ark_vrule *installed[ARK_MAX_INSTALLED];
static struct ark_vrule *all_rules;
/* Guards installed[], all_rules and every entry's qp pointer against ibv_destroy_qp. */
static pthread_mutex_t rules_mu = PTHREAD_MUTEX_INITIALIZER;

static modify_fn real_modify_fn;
static destroy_fn real_destroy_fn;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* The next definition after this library (the real libibverbs, or a further interposer);
 * failing that (a handle-local lookup that RTLD_NEXT cannot walk), libibverbs' own. */
static void *real_symbol(const char *name) {
    void *f = dlvsym(RTLD_NEXT, name, "IBVERBS_1.1");
    if (f) return f;
    void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) return NULL;
    f = dlvsym(h, name, "IBVERBS_1.1");
    dlclose(h); /* NOLOAD took a reference on a library that stays loaded */
    return f;
}

static void resolve_real(void) {
    real_modify_fn = (modify_fn)real_symbol("ibv_modify_qp");
    real_destroy_fn = (destroy_fn)real_symbol("ibv_destroy_qp");
}

static int real_modify(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) {
    pthread_once(&once, resolve_real);
    return real_modify_fn ? real_modify_fn(qp, attr, mask) : ENOSYS;
}

int ark_verbs_version(void) { return ARK_VERBS_VERSION; }

/* rdma_flow_label_to_udp_sport's inverse: the nonzero label that gives port (0: none). */
uint32_t ark_verbs_flow_label(int port) {
    if (port < ARK_SPORT_MIN || port > 0xFFFF) return 0;
    uint32_t fl = (uint32_t)port & 0x3FFF;
    return fl ? fl : 0x4001; /* label 0 means "derive from the QP numbers" */
}

/* rdma_get_udp_sport: the port the kernel derives for a label (0: from the QP numbers). */
static uint16_t kernel_sport(uint32_t fl, uint32_t lqpn, uint32_t rqpn) {
    if (!fl) {
        uint64_t v = (uint64_t)lqpn * rqpn;
        v ^= v >> 20;
        v ^= v >> 40;
        fl = (uint32_t)(v & 0xFFFFF);
    }
    uint32_t low = fl & 0x3FFF, high = fl & 0xFC000;
    low ^= high >> 14;
    return (uint16_t)(low | ARK_SPORT_MIN);
}

struct ark_vrule *ark_verbs_new(const uint8_t gid[16], int steer) {
    struct ark_vrule *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    memcpy(r->gid, gid, 16);
    r->steer = steer;
    r->nlanes = 1;
    r->log_fd = -1;
    pthread_mutex_lock(&rules_mu);
    r->next_rule = all_rules;
    all_rules = r;
    pthread_mutex_unlock(&rules_mu);
    return r;
}

/* Lock held: rules_mu. */
static void uninstall_locked(struct ark_vrule *r) {
    int n = atomic_load(&n_installed);
    for (int i = 0; i < n; i++) {
        if (installed[i] != r) continue;
        installed[i] = installed[n - 1];
        installed[n - 1] = NULL;
        atomic_store(&n_installed, n - 1);
        return;
    }
}

void ark_verbs_free(struct ark_vrule *r) {
    if (!r) return;
    if (current_rule == r) current_rule = NULL;
    pthread_mutex_lock(&rules_mu);
    uninstall_locked(r);
    for (struct ark_vrule **p = &all_rules; *p; p = &(*p)->next_rule) {
        if (*p == r) {
            *p = r->next_rule;
            break;
        }
    }
    while (r->users > 0) { /* an engine thread is connecting a QP with it: let it finish */
        pthread_mutex_unlock(&rules_mu);
        usleep(50);
        pthread_mutex_lock(&rules_mu);
    }
    pthread_mutex_unlock(&rules_mu);
    if (r->log_fd >= 0) close(r->log_fd);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void ark_verbs_enter(struct ark_vrule *r) { current_rule = r; }

void ark_verbs_leave(void) { current_rule = NULL; }

/* Every thread's RTRs towards the rule's peer; 0, or -1 when ARK_MAX_INSTALLED are. */
int ark_verbs_install(struct ark_vrule *r) {
    int rc = 0;
    pthread_mutex_lock(&rules_mu);
    uninstall_locked(r); /* installing twice keeps one entry */
    int n = atomic_load(&n_installed);
    if (n < ARK_MAX_INSTALLED) {
        installed[n] = r;
        atomic_store(&n_installed, n + 1);
    } else {
        rc = -1;
    }
    pthread_mutex_unlock(&rules_mu);
    return rc;
}

void ark_verbs_uninstall(struct ark_vrule *r) {
    pthread_mutex_lock(&rules_mu);
    uninstall_locked(r);
    pthread_mutex_unlock(&rules_mu);
}

/* Append ports (0xC000..0xFFFF: what a flow label reaches) with their lanes (NULL: lane
 * 0); returns how many the rule took (ports outside the range are not). */
/* Lock held: r->mu. */
static int add_locked(struct ark_vrule *r, const uint16_t *ports, const uint8_t *lanes, int n) {
    int added = 0;
    for (int i = 0; i < n && r->n < ARK_MAX_PORTS; i++) {
        if (ports[i] < ARK_SPORT_MIN) continue;
        uint8_t lane = lanes ? lanes[i] : 0;
        r->lanes[r->n] = lane;
        r->ports[r->n++] = ports[i];
        if (lane + 1 > r->nlanes) r->nlanes = lane + 1;
        added++;
    }
    return added;
}

int ark_verbs_add_lanes(struct ark_vrule *r, const uint16_t *ports, const uint8_t *lanes, int n) {
    pthread_mutex_lock(&r->mu);
    int added = add_locked(r, ports, lanes, n);
    pthread_mutex_unlock(&r->mu);
    return added;
}

/* Replace the ports (a re-pathed lease): QPs connected later use the new ones. One lock
 * for both steps: an RTR on another thread sees the old ports or the new, never none. */
int ark_verbs_set_lanes(struct ark_vrule *r, const uint16_t *ports, const uint8_t *lanes, int n) {
    pthread_mutex_lock(&r->mu);
    r->n = r->next = r->turn = 0;
    r->nlanes = 1;
    memset(r->lane_next, 0, sizeof(r->lane_next));
    int added = add_locked(r, ports, lanes, n);
    pthread_mutex_unlock(&r->mu);
    return added;
}

/* The QP log: appended to, its last path component never a symbolic link (O_NOFOLLOW
 * guards that one only: links in the directories above are followed), never a FIFO,
 * device or socket that could block or redirect the engine (opened without blocking, then
 * checked with fstat), and a terminal named there never becomes the engine's controlling
 * terminal (O_NOCTTY); -1 with errno (ELOOP: a link; EINVAL: not a regular file; ENXIO: a
 * FIFO no one reads). */
static int open_log(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        errno = EINVAL;
        return -1;
    }
    return fd;
}

static void set_log_fd(struct ark_vrule *r, int fd) {
    pthread_mutex_lock(&r->mu);
    if (r->log_fd >= 0) close(r->log_fd);
    r->log_fd = fd;
    pthread_mutex_unlock(&r->mu);
}

/* Also append every QP this rule logs to path (a regular file), one JSON line each; 0 or
 * -1 (errno). */
int ark_verbs_log_to(struct ark_vrule *r, const char *path) {
    int fd = open_log(path);
    if (fd < 0) return -1;
    set_log_fd(r, fd);
    return 0;
}

/* stats: steered, no port left, recorded only, re-paths, ports held. */
void ark_verbs_stats(struct ark_vrule *r, int out[5]) {
    pthread_mutex_lock(&r->mu);
    out[0] = r->steered;
    out[1] = r->no_port;
    out[2] = r->recorded;
    out[3] = r->repaths;
    out[4] = r->n;
    pthread_mutex_unlock(&r->mu);
}

/* Copy up to max entries as 7 integers each: qp_num, dest_qp_num, port, flow_label, lane,
 * kind (1 steered, 0 no port left, -1 recorded), repathed (2: the QP is gone since). */
int ark_verbs_log(struct ark_vrule *r, int64_t *out, int max) {
    pthread_mutex_lock(&rules_mu); /* qp pointers: cleared under it */
    pthread_mutex_lock(&r->mu);
    int n = r->nlog < max ? r->nlog : max;
    for (int i = 0; i < n; i++) {
        const struct ark_qp_entry *e = &r->log[i];
        int64_t *o = out + 7 * i;
        o[0] = e->qp_num;
        o[1] = e->dest_qp_num;
        o[2] = e->port;
        o[3] = e->flow_label;
        o[4] = e->lane;
        o[5] = e->kind;
        o[6] = e->qp ? e->repathed : 2;
    }
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_unlock(&rules_mu);
    return n;
}

/* The next port for a QP and its lane: lane turn % lanes first, else any. Lock held. */
static uint16_t take_port(struct ark_vrule *r, int *lane_out) {
    int lane = r->nlanes > 1 ? r->turn % r->nlanes : -1;
    for (int pass = 0; pass < 2 && r->n > 0; pass++, lane = -1) {
        int start = lane >= 0 ? r->lane_next[lane] : r->next;
        for (int t = 0; t < r->n; t++) {
            int i = (start + t) % r->n;
            if (lane >= 0 && r->lanes[i] != lane) continue;
            r->next = (i + 1) % r->n;
            r->lane_next[r->lanes[i]] = r->next;
            r->turn++;
            *lane_out = r->nlanes > 1 ? r->lanes[i] : -1;
            return r->ports[i];
        }
    }
    *lane_out = -1;
    return 0;
}

static void write_json(const struct ark_vrule *r, const struct ark_qp_entry *e) {
    static const char *kinds[] = {"recorded", "no_port", "steered"};
    char line[256];
    char peer[INET6_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET6, r->gid, peer, sizeof(peer));
    int n = snprintf(line, sizeof(line),
                     "{\"peer\": \"%s\", \"qp_num\": %u, \"dest_qp_num\": %u, \"port\": %u, \"flow_label\": %u, "
                     "\"lane\": %d, \"kind\": \"%s\", \"pid\": %d}\n",
                     peer, e->qp_num, e->dest_qp_num, e->port, e->flow_label, e->lane, kinds[e->kind + 1],
                     (int)getpid());
    if (n > 0 && n < (int)sizeof(line) && write(r->log_fd, line, (size_t)n) < 0) {
        /* the log file is a convenience: a full disk must not fail the engine's QP */
    }
}

/* Lock held: r->mu. */
static void log_qp(struct ark_vrule *r, const struct ark_qp_entry *e) {
    if (r->nlog < ARK_MAX_LOG) r->log[r->nlog++] = *e;
    if (r->log_fd >= 0) write_json(r, e);
}

/* What to do with this RTR: fill e (port, label, lane, kind) and the copy's label. */
static void plan_rtr(struct ark_vrule *r, struct ibv_qp *qp, struct ibv_qp_attr *copy, int mask,
                     struct ark_qp_entry *e) {
    memset(e, 0, sizeof(*e));
    e->qp = qp;
    e->qp_num = qp->qp_num;
    e->dest_qp_num = (mask & IBV_QP_DEST_QPN) ? copy->dest_qp_num : 0;
    e->lane = -1;
    uint16_t port = 0;
    int lane = -1;
    pthread_mutex_lock(&r->mu);
    if (r->steer) port = take_port(r, &lane);
    pthread_mutex_unlock(&r->mu);
    if (port) {
        copy->ah_attr.grh.flow_label = ark_verbs_flow_label(port);
        e->kind = KIND_STEERED;
        e->lane = (int16_t)lane;
    } else {
        e->kind = r->steer ? KIND_NO_PORT : KIND_RECORDED;
        port = kernel_sport(copy->ah_attr.grh.flow_label, e->qp_num, e->dest_qp_num);
    }
    e->port = port;
    e->flow_label = copy->ah_attr.grh.flow_label;
}

static int steer_rtr(struct ark_vrule *r, struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) {
    struct ibv_qp_attr copy = *attr; /* the caller's attributes stay as it wrote them */
    struct ark_qp_entry e;
    plan_rtr(r, qp, &copy, mask, &e);
    int rc = real_modify(qp, &copy, mask);
    if (rc) return rc; /* not connected: nothing to log, the engine will retry or give up */
    pthread_mutex_lock(&r->mu);
    r->steered += e.kind == KIND_STEERED;
    r->no_port += e.kind == KIND_NO_PORT;
    r->recorded += e.kind == KIND_RECORDED;
    log_qp(r, &e);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static int is_rtr_with_grh(const struct ibv_qp *qp, const struct ibv_qp_attr *attr, int mask) {
    /* RTR is reachable from INIT only, so qp_state RTR is the INIT -> RTR transition. */
    return qp && attr && (mask & IBV_QP_STATE) && (mask & IBV_QP_AV) && attr->qp_state == IBV_QPS_RTR &&
           attr->ah_attr.is_global && (qp->qp_type == IBV_QPT_RC || qp->qp_type == IBV_QPT_UC);
}

/* Lock held: rules_mu. Is r a rule not freed yet? (A thread's rule may have been freed by
 * another thread while this one was still inside it: never touch it then.) */
static int live_locked(const struct ark_vrule *r) {
    for (const struct ark_vrule *p = all_rules; p; p = p->next_rule)
        if (p == r) return 1;
    return 0;
}

/* The rule for an RTR towards gid: the thread's, else an installed one; held (users) so
 * that ark_verbs_free waits for the RTR to finish with it. NULL: none. */
static struct ark_vrule *hold_rule(struct ark_vrule *mine, const uint8_t *gid) {
    struct ark_vrule *found = NULL;
    pthread_mutex_lock(&rules_mu);
    if (mine && !live_locked(mine)) mine = current_rule = NULL;
    if (mine && memcmp(mine->gid, gid, 16) == 0) found = mine;
    int n = atomic_load(&n_installed);
    for (int i = 0; i < n && !found; i++)
        if (memcmp(installed[i]->gid, gid, 16) == 0) found = installed[i];
    if (found) found->users++;
    pthread_mutex_unlock(&rules_mu);
    return found;
}

static void release_rule(struct ark_vrule *r) {
    pthread_mutex_lock(&rules_mu);
    r->users--;
    pthread_mutex_unlock(&rules_mu);
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask) {
    struct ark_vrule *mine = current_rule;
    if (!mine && atomic_load_explicit(&n_installed, memory_order_relaxed) == 0)
        return real_modify(qp, attr, attr_mask);
    if (!is_rtr_with_grh(qp, attr, attr_mask)) return real_modify(qp, attr, attr_mask);
    struct ark_vrule *r = hold_rule(mine, attr->ah_attr.grh.dgid.raw);
    if (!r) return real_modify(qp, attr, attr_mask);
    int rc = steer_rtr(r, qp, attr, attr_mask);
    release_rule(r);
    return rc;
}

/* Forget a QP the engine destroys, so that a later re-path never touches freed memory. */
int ibv_destroy_qp(struct ibv_qp *qp) {
    pthread_once(&once, resolve_real);
    /* The entry is cleared before the real destroy (a re-path holding rules_mu must never
     * use a QP being freed); a destroy that then fails leaves that QP unknown to re-paths. */
    pthread_mutex_lock(&rules_mu);
    for (struct ark_vrule *r = all_rules; r; r = r->next_rule) {
        pthread_mutex_lock(&r->mu);
        for (int i = 0; i < r->nlog; i++)
            if (r->log[i].qp == qp) r->log[i].qp = NULL;
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&rules_mu);
    return real_destroy_fn ? real_destroy_fn(qp) : ENOSYS;
}

static sport_fn find_mlx5dv(void) {
    void *f = dlsym(RTLD_DEFAULT, "mlx5dv_modify_qp_udp_sport");
    if (f) return (sport_fn)f;
    /* libibverbs loads the mlx5 provider (libmlx5.so.1) locally: only reachable by name */
    void *h = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) return NULL;
    f = dlsym(h, "mlx5dv_modify_qp_udp_sport");
    dlclose(h);
    return (sport_fn)f;
}

/* Whether mlx5dv_modify_qp_udp_sport is in this process (live re-paths possible). */
int ark_verbs_can_repath(void) { return find_mlx5dv() != NULL; }

/* Move the rule's latest live QP numbered qp_num to port (a QP in RTS): 0, ARK_NO_MLX5DV,
 * ARK_NO_QP, ARK_BAD_PORT, or the errno mlx5dv returned (EOPNOTSUPP: no capability, not
 * mlx5, not RTS). The QP keeps its path unless 0. */
int ark_verbs_repath(struct ark_vrule *r, uint32_t qp_num, int port) {
    if (port < 1 || port > 0xFFFF) return ARK_BAD_PORT;
    sport_fn set_sport = find_mlx5dv();
    if (!set_sport) return ARK_NO_MLX5DV;
    int rc = ARK_NO_QP;
    pthread_mutex_lock(&rules_mu); /* the QP cannot be destroyed meanwhile */
    pthread_mutex_lock(&r->mu);
    struct ark_qp_entry *e = NULL;
    for (int i = r->nlog - 1; i >= 0 && !e; i--)
        if (r->log[i].qp_num == qp_num && r->log[i].qp) e = &r->log[i];
    pthread_mutex_unlock(&r->mu);
    if (e) rc = set_sport(e->qp, (uint16_t)port);
    if (e && rc == 0) {
        pthread_mutex_lock(&r->mu);
        e->port = (uint16_t)port;
        e->flow_label = 0; /* the port was set directly, not through a label */
        e->repathed = 1;
        r->repaths++;
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&rules_mu);
    return rc;
}

/* ---------------------------------------------------------------- ARK_VERBS_RULES */

static int parse_peer(const char *s, uint8_t gid[16]) {
    struct in_addr a4;
    memset(gid, 0, 16);
    if (inet_pton(AF_INET, s, &a4) == 1) { /* RoCEv2 over IPv4: ::ffff:a.b.c.d */
        gid[10] = gid[11] = 0xFF;
        memcpy(gid + 12, &a4, 4);
        return 0;
    }
    return inet_pton(AF_INET6, s, gid) == 1 ? 0 : -1;
}

/* "PORT[/LANE],PORT[/LANE]..." into the rule; -1 on the first bad item or none at all,
 * -2 past ARK_MAX_PORTS. */
static int parse_ports(struct ark_vrule *r, char *list) {
    char *save = NULL;
    int n = 0;
    for (char *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save), n++) {
        char *end = NULL;
        long port = strtol(item, &end, 10), lane = 0;
        if (*end == '/') {
            char *digits = end + 1;
            lane = strtol(digits, &end, 10);
            if (end == digits) return -1; /* "PORT/" names no lane */
        }
        if (*end || port < ARK_SPORT_MIN || port > 0xFFFF || lane < 0 || lane > 255) return -1;
        uint16_t p = (uint16_t)port;
        uint8_t l = (uint8_t)lane;
        if (ark_verbs_add_lanes(r, &p, &l, 1) != 1) return -2;
    }
    return n ? 0 : -1;
}

/* spec, at most max - 1 characters of it, with anything unprintable as '?' (one line). */
static void printable(char *out, size_t max, const char *spec) {
    size_t i = 0;
    for (; spec[i] && i + 1 < max; i++) out[i] = (spec[i] >= 0x20 && spec[i] < 0x7F) ? spec[i] : '?';
    out[i] = '\0';
}

/* One "PEER=PORT[/LANE],..." into a new rule (not installed), or NULL with why filled. */
static struct ark_vrule *env_rule(char *spec, char *why, size_t whylen) {
    char shown[65];
    char *eq = strchr(spec, '=');
    uint8_t gid[16];
    if (!eq) {
        printable(shown, sizeof(shown), spec);
        snprintf(why, whylen, "expected PEER=PORT,...; got %s", shown);
        return NULL;
    }
    *eq = '\0';
    printable(shown, sizeof(shown), spec);
    if (parse_peer(spec, gid) != 0) {
        snprintf(why, whylen, "%s is not an IPv4 or IPv6 address", shown);
        return NULL;
    }
    struct ark_vrule *r = ark_verbs_new(gid, 1);
    if (!r) {
        snprintf(why, whylen, "%s: out of memory", shown);
        return NULL;
    }
    int rc = parse_ports(r, eq + 1);
    if (rc != 0) {
        if (rc == -2)
            snprintf(why, whylen, "%s: at most %d ports per peer", shown, ARK_MAX_PORTS);
        else
            snprintf(why, whylen, "%s: ports must be 49152..65535[/LANE 0..255]", shown);
        ark_verbs_free(r);
        return NULL;
    }
    return r;
}

/* Every rule's QPs also to ARK_VERBS_LOG (one descriptor each); one line if it cannot be. */
static void env_log(struct ark_vrule **rules, int n, const char *path) {
    if (!path || !*path || n == 0) return;
    char shown[129];
    printable(shown, sizeof(shown), path);
    int fd = open_log(path);
    if (fd < 0) {
        fprintf(stderr, "ark verbs: ARK_VERBS_LOG: %s: %s; QPs are not logged to a file\n", shown,
                (errno == EINVAL || errno == ENXIO) ? "not a regular file" : errno == ELOOP ? "a symbolic link" : strerror(errno));
        return;
    }
    for (int i = 0; i < n; i++) {
        int one = i + 1 < n ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : fd;
        if (one >= 0) set_log_fd(rules[i], one);
    }
}

/* All parsed rules installed, or none (then freed): 0 or -1. */
static int env_install(struct ark_vrule **rules, int n) {
    for (int i = 0; i < n; i++) {
        if (ark_verbs_install(rules[i]) != 0) {
            for (int k = 0; k < i; k++) ark_verbs_uninstall(rules[k]);
            return -1;
        }
    }
    return 0;
}

/* Process rules from the environment, for engines ARK's Python never runs inside:
 * ARK_VERBS_RULES="PEER=PORT[/LANE],...;PEER=..." (ARK_VERBS_LOG: a JSON-lines file). All
 * or nothing: one malformed rule, or more than ARK_MAX_INSTALLED, and none is installed;
 * whatever was wrong is one line on stderr (how many, and the first reason). */
__attribute__((constructor)) static void env_rules(void) {
    const char *spec = getenv("ARK_VERBS_RULES");
    if (!spec || !*spec) return;
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return;
    static struct ark_vrule *rules[ARK_MAX_INSTALLED];
    char first[200] = "", why[200];
    int n = 0, total = 0, bad = 0;
    for (char *one = strtok_r(copy, ";", &save); one; one = strtok_r(NULL, ";", &save)) {
        total++;
        struct ark_vrule *r = env_rule(one, why, sizeof(why));
        if (!r) {
            if (!bad++) memcpy(first, why, sizeof(first));
        } else if (bad || n == ARK_MAX_INSTALLED) {
            ark_verbs_free(r); /* none is installed anyway */
        } else {
            rules[n++] = r;
        }
    }
    free(copy);
    why[0] = '\0';
    if (bad) {
        snprintf(why, sizeof(why), " (%d of %d rules malformed)", bad, total);
    } else if (total > ARK_MAX_INSTALLED) {
        snprintf(first, sizeof(first), "at most %d rules; got %d", ARK_MAX_INSTALLED, total);
    } else if (env_install(rules, n) != 0) {
        snprintf(first, sizeof(first), "at most %d rules installed at once", ARK_MAX_INSTALLED);
    } else {
        env_log(rules, n, getenv("ARK_VERBS_LOG"));
        return;
    }
    for (int i = 0; i < n; i++) ark_verbs_free(rules[i]);
    fprintf(stderr, "ark verbs: ARK_VERBS_RULES: %s%s; none installed\n", first, why);
}
