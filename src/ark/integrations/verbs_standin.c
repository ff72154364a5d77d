/* A STAND-IN for libibverbs.so.1 (and for libmlx5.so.1's mlx5dv_modify_qp_udp_sport): NOT a
 * verbs implementation. It exists so that ARK's verbs interposer (verbs.c) can be tested and
 * timed on machines without RDMA devices: it exports the same versioned symbols (IBVERBS_1.1,
 * and ibv_modify_qp's compatibility version IBVERBS_1.0, by the version script
 * ark.integrations.verbs_standin writes after rdma-core's) that engines link against or
 * dlvsym, and its QP calls only record what they were given. Nothing reaches a kernel or a
 * wire; what a real NIC does with a flow label is checked by ark testbed roce-check.
 *
 * One file, three parts, each compiled on its own:
 *   ARK_STANDIN_CORE   ibv_create_qp / ibv_modify_qp / ibv_destroy_qp that record, and the
 *                      standin_* functions tests read the records with (real <infiniband/verbs.h>);
 *   ARK_STANDIN_STUBS  the rest of what NCCL dlvsym()s from its verbs library, each failing
 *                      with ENOSYS (no verbs.h: their real prototypes do not matter here);
 *   ARK_STANDIN_MLX5   mlx5dv_modify_qp_udp_sport with rdma-core's preconditions (RC or UC
 *                      QP in RTS).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STANDIN_MAX 65536

#if defined(ARK_STANDIN_CORE) || defined(ARK_STANDIN_MLX5)
#include <infiniband/verbs.h>
#include <pthread.h>
#endif

#ifdef ARK_STANDIN_CORE
struct standin_rec {
    uint32_t qp_num, dest_qp_num, flow_label;
    int mask, state, is_global, qp_type, version;
    uint8_t dgid[16];
};

static struct standin_rec recs[STANDIN_MAX];
static int nrec, fail_rtr;
static uint32_t next_qpn = 0x100;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init) {
    struct ibv_qp *qp = calloc(1, sizeof(*qp));
    if (!qp) return NULL;
    pthread_mutex_lock(&mu);
    qp->qp_num = next_qpn++;
    pthread_mutex_unlock(&mu);
    qp->pd = pd;
    qp->qp_type = init->qp_type;
    qp->state = IBV_QPS_RESET;
    return qp;
}

/* Records the call (``version``: 11 for ibv_modify_qp@@IBVERBS_1.1, 10 for the compatibility
 * symbol @IBVERBS_1.0); like libibverbs, the QP's state follows a successful transition. */
static int record_modify(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask, int version) {
    pthread_mutex_lock(&mu);
    int rc = 0;
    if ((mask & IBV_QP_STATE) && attr->qp_state == IBV_QPS_RTR) {
        rc = fail_rtr;
        fail_rtr = 0;
    }
    if (nrec < STANDIN_MAX) {
        struct standin_rec *r = &recs[nrec++];
        r->qp_num = qp->qp_num;
        r->dest_qp_num = attr->dest_qp_num;
        r->flow_label = attr->ah_attr.grh.flow_label;
        r->mask = mask;
        r->state = (mask & IBV_QP_STATE) ? (int)attr->qp_state : -1;
        r->is_global = attr->ah_attr.is_global;
        r->qp_type = qp->qp_type;
        r->version = version;
        memcpy(r->dgid, attr->ah_attr.grh.dgid.raw, 16);
    }
    pthread_mutex_unlock(&mu);
    if (!rc && (mask & IBV_QP_STATE)) qp->state = attr->qp_state;
    return rc;
}

/* Both versions rdma-core's libibverbs exports (libibverbs.map.in): the default, and the
 * compatibility symbol that binaries linked before IBVERBS_1.1 (2006) still call. */
int sv_modify_qp_1_1(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
int sv_modify_qp_1_0(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
int sv_modify_qp_1_1(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) { return record_modify(qp, attr, mask, 11); }
int sv_modify_qp_1_0(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) { return record_modify(qp, attr, mask, 10); }
__asm__(".symver sv_modify_qp_1_1, ibv_modify_qp@@IBVERBS_1.1");
__asm__(".symver sv_modify_qp_1_0, ibv_modify_qp@IBVERBS_1.0");

int ibv_destroy_qp(struct ibv_qp *qp) {
    free(qp);
    return 0;
}

/* The next ibv_modify_qp to RTR fails with rc (an errno value, as libibverbs returns). */
void standin_fail_next_rtr(int rc) {
    pthread_mutex_lock(&mu);
    fail_rtr = rc;
    pthread_mutex_unlock(&mu);
}

void standin_reset(void) {
    pthread_mutex_lock(&mu);
    nrec = 0;
    pthread_mutex_unlock(&mu);
}

/* Copy up to max records as 11 integers each: qp_num, dest_qp_num, flow_label, mask,
 * state (-1: not in the mask), is_global, qp_type, then the dgid's last 4 bytes (an
 * IPv4-mapped GID's address) as one big-endian integer, the mapped flag, the symbol
 * version called (11 or 10) and a zero. */
int standin_records(int64_t *out, int max) {
    pthread_mutex_lock(&mu);
    int n = nrec < max ? nrec : max;
    for (int i = 0; i < n; i++) {
        const struct standin_rec *r = &recs[i];
        int64_t *o = out + 11 * i;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF};
        o[0] = r->qp_num;
        o[1] = r->dest_qp_num;
        o[2] = r->flow_label;
        o[3] = r->mask;
        o[4] = r->state;
        o[5] = r->is_global;
        o[6] = r->qp_type;
        o[7] = ((int64_t)r->dgid[12] << 24) | (r->dgid[13] << 16) | (r->dgid[14] << 8) | r->dgid[15];
        o[8] = memcmp(r->dgid, mapped, 12) == 0;
        o[9] = r->version;
        o[10] = 0;
    }
    pthread_mutex_unlock(&mu);
    return n;
}
#endif /* ARK_STANDIN_CORE */

#ifdef ARK_STANDIN_STUBS
#define STUB(name)                                                                                            \
    void *name(void) {                                                                                     \
        errno = ENOSYS;                                                                                    \
        return 0;                                                                                          \
    }
STUB(ibv_get_device_list)
STUB(ibv_free_device_list)
STUB(ibv_get_device_name)
STUB(ibv_open_device)
STUB(ibv_close_device)
STUB(ibv_get_async_event)
STUB(ibv_ack_async_event)
STUB(ibv_query_device)
STUB(ibv_query_port)
STUB(ibv_query_gid)
STUB(ibv_query_qp)
STUB(ibv_alloc_pd)
STUB(ibv_dealloc_pd)
STUB(ibv_reg_mr)
STUB(ibv_dereg_mr)
STUB(ibv_create_cq)
STUB(ibv_destroy_cq)
STUB(ibv_fork_init)
STUB(ibv_event_type_str)
#endif /* ARK_STANDIN_STUBS */

#ifdef ARK_STANDIN_MLX5
/* rdma-core's checks (providers/mlx5/mlx5.c): RC or UC, in RTS; the capability is assumed. */
int mlx5dv_modify_qp_udp_sport(struct ibv_qp *qp, uint16_t udp_sport) {
    (void)udp_sport;
    if ((qp->qp_type != IBV_QPT_RC && qp->qp_type != IBV_QPT_UC) || qp->state != IBV_QPS_RTS) return EOPNOTSUPP;
    return 0;
}
#endif /* ARK_STANDIN_MLX5 */
