/* A miniature RDMA "engine" for testing and timing ARK's verbs interposer against the
 * stand-in libibverbs (verbs_standin.c): it connects QPs the way engines do (RESET -> INIT
 * -> RTR -> RTS, a GRH towards the peer's IPv4-mapped GID on RoCEv2), either through
 * functions linked from libibverbs.so.1 (Mooncake, UCX, librdmacm users) or through a
 * library it dlopen()s and dlvsym()s itself, as NCCL does (with NCCL's list of symbols).
 *
 * Built twice by ark.integrations.verbs_standin: as libarkengine.so (tests call eng_* with
 * ctypes, from a process that may also drive ARK's rules) and, with ARK_ENGINE_MAIN, as the
 * program verbs-engine (an engine ARK's Python never runs inside: rules from the
 * environment only). Both link against the stand-in's libibverbs.so.1.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct ibv_qp *(*create_fn)(struct ibv_pd *, struct ibv_qp_init_attr *);
typedef int (*modify_fn)(struct ibv_qp *, struct ibv_qp_attr *, int);
typedef int (*destroy_fn)(struct ibv_qp *);

struct verbs {
    create_fn create;
    modify_fn modify;
    destroy_fn destroy;
};

/* What NCCL resolves with dlvsym(handle, name, "IBVERBS_1.1") and refuses to start without. */
static const char *const nccl_symbols[] = {
    "ibv_get_device_list", "ibv_free_device_list", "ibv_get_device_name", "ibv_open_device",
    "ibv_close_device",    "ibv_get_async_event",  "ibv_ack_async_event", "ibv_query_device",
    "ibv_query_port",      "ibv_query_gid",        "ibv_query_qp",        "ibv_alloc_pd",
    "ibv_dealloc_pd",      "ibv_reg_mr",           "ibv_dereg_mr",        "ibv_create_cq",
    "ibv_destroy_cq",      "ibv_create_qp",        "ibv_modify_qp",       "ibv_destroy_qp",
    "ibv_fork_init",       "ibv_event_type_str",
};

static int peer_gid(const char *peer, union ibv_gid *gid) {
    struct in_addr a4;
    memset(gid, 0, sizeof(*gid));
    if (inet_pton(AF_INET, peer, &a4) == 1) {
        gid->raw[10] = gid->raw[11] = 0xFF;
        memcpy(gid->raw + 12, &a4, 4);
        return 0;
    }
    return inet_pton(AF_INET6, peer, gid->raw) == 1 ? 0 : -1;
}

static int to_init(const struct verbs *v, struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    return v->modify(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

/* INIT -> RTR as NCCL and Mooncake write it (flow label 0); -2 if the call changed the
 * caller's attributes (an interposer must work on a copy). */
static int to_rtr(const struct verbs *v, struct ibv_qp *qp, const union ibv_gid *gid, int global, uint32_t dqpn) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dqpn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = (uint8_t)global;
    a.ah_attr.grh.dgid = *gid;
    a.ah_attr.grh.hop_limit = 255;
    a.ah_attr.grh.flow_label = 0;
    a.ah_attr.port_num = 1;
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (qp->qp_type == IBV_QPT_RC) mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (qp->qp_type == IBV_QPT_UD) mask = IBV_QP_STATE; /* UD: no address vector at RTR */
    int rc = v->modify(qp, &a, mask);
    return rc ? rc : (a.ah_attr.grh.flow_label != 0 ? -2 : 0);
}

static int to_rts(const struct verbs *v, struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    return v->modify(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Connect n QPs of qp_type to peer; their numbers in qpns. keep: 0 destroy them, 1 leave
 * them alive in RTS (a later re-path), 2 alive but left in RTR. Returns how many connected, or -1 (bad peer), or the first
 * failing call's result as a negative number below -2 (-2: attributes changed). */
static int connect_with(const struct verbs *v, const char *peer, int qp_type, int n, int global, uint32_t *qpns,
                        int keep) {
    union ibv_gid gid;
    if (peer_gid(peer, &gid) != 0) return -1;
    for (int i = 0; i < n; i++) {
        struct ibv_qp_init_attr init;
        memset(&init, 0, sizeof(init));
        init.qp_type = (enum ibv_qp_type)qp_type;
        struct ibv_qp *qp = v->create(NULL, &init);
        if (!qp) return -1;
        int rc = to_init(v, qp);
        if (!rc) rc = to_rtr(v, qp, &gid, global, 0x9000u + (uint32_t)i);
        if (!rc && keep != 2) rc = to_rts(v, qp);
        if (qpns) qpns[i] = qp->qp_num;
        if (!keep) v->destroy(qp);
        if (rc) return rc == -2 ? -2 : -100 - rc;
    }
    return n;
}

static const struct verbs linked = {ibv_create_qp, ibv_modify_qp, ibv_destroy_qp};

int eng_connect(const char *peer, int qp_type, int n, int global, uint32_t *qpns, int keep) {
    return connect_with(&linked, peer, qp_type, n, global, qpns, keep);
}

/* A binary linked against a libibverbs before IBVERBS_1.1 (2006): its reference binds to the
 * compatibility symbol ibv_modify_qp@IBVERBS_1.0, which the interposer does not define. */
int old_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
__asm__(".symver old_modify_qp, ibv_modify_qp@IBVERBS_1.0");
static const struct verbs linked_1_0 = {ibv_create_qp, old_modify_qp, ibv_destroy_qp};

int eng_connect_1_0(const char *peer, int n, uint32_t *qpns) {
    return connect_with(&linked_1_0, peer, IBV_QPT_RC, n, 1, qpns, 0);
}

/* Like NCCL: dlopen(lib), dlvsym every symbol NCCL needs at IBVERBS_1.1 (the names it
 * could not find, space-separated, in missing: then -1), and connect n RC QPs through them. */
int eng_dlvsym_connect(const char *lib, const char *peer, int n, uint32_t *qpns, char *missing, int len) {
    void *h = dlopen(lib, RTLD_NOW);
    missing[0] = '\0';
    if (!h) {
        snprintf(missing, (size_t)len, "dlopen: %s", dlerror());
        return -1;
    }
    for (size_t i = 0; i < sizeof(nccl_symbols) / sizeof(nccl_symbols[0]); i++) {
        if (dlvsym(h, nccl_symbols[i], "IBVERBS_1.1")) continue;
        size_t used = strlen(missing);
        snprintf(missing + used, (size_t)len - used, "%s%s", used ? " " : "", nccl_symbols[i]);
    }
    if (missing[0]) return -1;
    struct verbs v = {(create_fn)dlvsym(h, "ibv_create_qp", "IBVERBS_1.1"),
                      (modify_fn)dlvsym(h, "ibv_modify_qp", "IBVERBS_1.1"),
                      (destroy_fn)dlvsym(h, "ibv_destroy_qp", "IBVERBS_1.1")};
    return connect_with(&v, peer, IBV_QPT_RC, n, 1, qpns, 0); /* h stays open, as NCCL's does */
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Time `calls` INIT -> RTR modifies of one RC QP towards peer (ns each, in ns_out): what an
 * engine pays per QP it connects. Returns calls, or -1. */
int eng_time_rtr(const char *peer, int calls, int64_t *ns_out) {
    union ibv_gid gid;
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof(init));
    init.qp_type = IBV_QPT_RC;
    if (peer_gid(peer, &gid) != 0) return -1;
    struct ibv_qp *qp = ibv_create_qp(NULL, &init);
    if (!qp) return -1;
    for (int i = 0; i < calls; i++) {
        int64_t t0 = now_ns();
        int rc = to_rtr(&linked, qp, &gid, 1, 0x9000);
        ns_out[i] = now_ns() - t0;
        if (rc) {
            ibv_destroy_qp(qp);
            return -1;
        }
    }
    ibv_destroy_qp(qp);
    return calls;
}

#ifdef ARK_ENGINE_MAIN
int standin_records(int64_t *out, int max);

/* verbs-engine linked PEER N [QP_TYPE GLOBAL] | verbs-engine dlvsym LIB PEER N: connect,
 * then print the stand-in's records of the RTR calls, one JSON object per line. */
int main(int argc, char **argv) {
    int n = -1;
    char missing[1024] = "";
    if (argc >= 4 && strcmp(argv[1], "linked") == 0)
        n = eng_connect(argv[2], argc > 4 ? atoi(argv[4]) : IBV_QPT_RC, atoi(argv[3]), argc > 5 ? atoi(argv[5]) : 1,
                        NULL, 0);
    else if (argc == 5 && strcmp(argv[1], "dlvsym") == 0)
        n = eng_dlvsym_connect(argv[2], argv[3], atoi(argv[4]), NULL, missing, (int)sizeof(missing));
    else {
        fprintf(stderr, "usage: verbs-engine linked PEER N [QP_TYPE GLOBAL] | dlvsym LIB PEER N\n");
        return 2;
    }
    if (n < 0) {
        fprintf(stderr, "verbs-engine: connect failed (%d) %s\n", n, missing);
        return 1;
    }
    static int64_t recs[4096 * 11];
    int k = standin_records(recs, 4096);
    for (int i = 0; i < k; i++) {
        const int64_t *r = recs + 11 * i;
        if (r[4] != IBV_QPS_RTR) continue;
        printf("{\"qp_num\": %lld, \"flow_label\": %lld, \"is_global\": %lld}\n", (long long)r[0], (long long)r[2],
               (long long)r[5]);
    }
    return 0;
}
#endif
