// The admin API: the CLI's admin commands as JSON over HTTP, behind a bearer token compared in
// constant time. No ADMIN_TOKEN configured: these routes do not exist (404).
import type { IncomingMessage } from 'node:http';
import type { PgBoss } from 'pg-boss';
import { z } from 'zod';
import { acknowledgeOperation } from '../admin/acknowledge.ts';
import { listOperations, showOperation } from '../admin/operations.ts';
import { requeueOperation, requeueStuck } from '../admin/requeue.ts';
import { ResolutionRefused, resolveOperation } from '../admin/resolve.ts';
import type { Config } from '../runtime/config.ts';
import type { Pool } from '../db/pool.ts';
import type { Metrics } from '../telemetry/metrics.ts';
import type { Logger } from '../telemetry/log.ts';
import { ValidationError } from '../types/errors.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import { OperationNotFoundError } from '../engine/operation.ts';
import { reconcileNow } from '../admin/reconcile.ts';
import { HttpError, readBody, sendJson, type Handler, type Route } from './server.ts';
import { accessOf, accessTokens, checkToken, tokenSubjects, type Access } from './tokens.ts';

export interface AdminDeps {
  pool: Pool;
  boss: PgBoss;
  /** Stripe as evidence for resolve and reconcile; undefined when this replica has none (its emulator's
   * ledger is its own): those routes then refuse rather than judge by it. */
  gateway: PaymentGateway | undefined;
  log: Logger;
  config: Config;
  workerId: string;
  /** The replica's metrics, where the console counts refused sign-ins. */
  metrics?: Pick<Metrics, 'tokenRefusals'>;
}

/** Why resolve, reconcile and the drift report refuse on a replica without Stripe evidence. */
export const NO_EVIDENCE =
  'this replica has no Stripe to check evidence against (STRIPE_SECRET_KEY unset, DATABASE_URL set, its emulator knows only its own charges): set STRIPE_SECRET_KEY, or STRIPE_API_BASE to the emulator the workers share';

/** The caller's token, under the client's throttle: a read, or an action (only ADMIN_TOKEN acts). */
async function authorize(pool: Pool, req: IncomingMessage, tokens: [string, Access][], needs: Access, metrics: AdminDeps['metrics']): Promise<void> {
  const m = /^Bearer (\S+)$/.exec(String(req.headers.authorization ?? ''));
  if (!m) throw new HttpError(401, 'unauthorized', 'Authorization: Bearer <ADMIN_TOKEN> is required');
  let check;
  try {
    check = await checkToken(pool, tokenSubjects(req), m[1]!, tokens);
  } catch (err) {
    // The throttle could not be read (the database is down): nobody gets in, and only a token holder is
    // told why, as for any other failure behind the token.
    if (accessOf(m[1]!, tokens)) throw new HttpError(500, 'internal', (err as Error).message, { cause: err });
    throw err;
  }
  if ('refused' in check) {
    metrics?.tokenRefusals.inc({ reason: check.refused, where: 'admin_api' });
    if (check.wait > 0) throw new HttpError(429, 'throttled', `too many wrong tokens from this client: try again in ${check.wait} s`, { retryAfterSeconds: check.wait });
    throw new HttpError(403, 'forbidden', 'token not accepted');
  }
  if (needs === 'act' && check.access === 'read') throw new HttpError(403, 'read_only', 'this token reads only: it may not change anything');
}

async function jsonBody<T>(req: IncomingMessage, schema: z.ZodType<T>): Promise<T> {
  const raw = (await readBody(req, 64 * 1024)).toString('utf8');
  let parsed: unknown;
  try {
    parsed = raw ? JSON.parse(raw) : {};
  } catch {
    throw new HttpError(422, 'invalid_json', 'the body is not JSON');
  }
  const result = schema.safeParse(parsed);
  if (!result.success) {
    const issue = result.error.issues[0]!;
    throw new HttpError(422, 'invalid_input', `${issue.path.join('.') || 'body'}: ${issue.message}`);
  }
  return result.data;
}

// reviewReason: the review reason as the caller read it (null: none), refused if it changed since; given,
// a discrepancy read is answered by the resolution, otherwise it stays until acknowledged.
const seenReason = { reviewReason: z.string().nullable().optional() };
const resolveBody = z.discriminatedUnion('outcome', [
  // Checked against the operation's kind by the resolution (pi_… for a charge, re_… for a refund).
  z.strictObject({ outcome: z.literal('succeeded'), externalId: z.string().trim().min(1).max(255), ...seenReason }),
  z.strictObject({ outcome: z.literal('failed'), reason: z.string().trim().min(1).max(1000), ...seenReason }),
]);
const requeueBody = z.strictObject({ dryRun: z.boolean().optional() });
// reviewReason: the reason as the caller read it (GET /admin/operations/{id}): one that changed since is refused.
const acknowledgeBody = z.strictObject({ note: z.string().trim().min(1).max(1000), reviewReason: z.string().min(1) });
const stuckBody = z.strictObject({
  olderThanSeconds: z.number().int().min(0).max(30 * 86400).default(600),
  dryRun: z.boolean().optional(),
});
const listQuery = z.object({
  status: z.enum(['pending', 'unknown', 'succeeded', 'failed']).optional(),
  needs_review: z.enum(['true', 'false']).optional(),
  limit: z.coerce.number().int().min(1).max(1000).default(1000),
  order: z.enum(['oldest', 'newest']).default('oldest'),
});

const OP = /^\/admin\/operations\/([^/]+)$/;
const OP_ACTION = (action: string) => new RegExp(`^/admin/operations/([^/]+)/${action}$`);

export function adminRoutes(deps: AdminDeps): Route[] {
  const tokens = accessTokens(deps.config);
  if (tokens.length === 0) return [];
  const actor = `token:${deps.config.admin.tokenName}`;

  /** Auth first (a read, or an action: only ADMIN_TOKEN acts), then the domain's errors as HTTP statuses. */
  const guarded =
    (handler: Handler, needs: Access = 'act'): Handler =>
    async (r) => {
      await authorize(deps.pool, r.req, tokens, needs, deps.metrics);
      try {
        await handler(r);
      } catch (err) {
        if (err instanceof ValidationError) throw new HttpError(422, 'invalid_input', err.message);
        if (err instanceof OperationNotFoundError) throw new HttpError(404, 'not_found', err.message);
        if (err instanceof ResolutionRefused) throw new HttpError(422, 'refused', err.message);
        // Behind the token, an operator is shown what failed (elsewhere a 500 says nothing of its cause).
        if (!(err instanceof HttpError)) throw new HttpError(500, 'internal', (err as Error).message, { cause: err });
        throw err;
      }
    };

  const evidence = (): PaymentGateway => {
    if (deps.gateway) return deps.gateway;
    throw new HttpError(409, 'no_evidence', NO_EVIDENCE);
  };

  return [
    [
      'GET',
      '/admin/operations',
      guarded(async ({ url, res }) => {
        const q = listQuery.safeParse(Object.fromEntries(url.searchParams));
        if (!q.success) throw new HttpError(422, 'invalid_input', q.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; '));
        const rows = await listOperations(deps.pool, { status: q.data.status, needsReview: q.data.needs_review === 'true', limit: q.data.limit, newestFirst: q.data.order === 'newest' });
        sendJson(res, 200, { operations: rows });
      }, 'read'),
    ],
    ['GET', OP, guarded(async ({ res, params }) => sendJson(res, 200, await showOperation(deps.pool, params[0]!)), 'read')],
    [
      'POST',
      OP_ACTION('resolve'),
      guarded(async ({ req, res, params }) => {
        const { reviewReason, ...resolution } = await jsonBody(req, resolveBody);
        const opts = { leaseTtlMs: deps.config.worker.leaseTtlMs, searchFreshnessSeconds: deps.config.searchFreshnessSeconds, reviewReasonSeen: reviewReason };
        sendJson(res, 200, await resolveOperation(deps.pool, evidence(), params[0]!, resolution, actor, opts));
      }),
    ],
    [
      'POST',
      OP_ACTION('requeue'),
      guarded(async ({ req, res, params }) => {
        const body = await jsonBody(req, requeueBody);
        const result = await requeueOperation(deps.pool, deps.boss, params[0]!, { actor, dryRun: !!body.dryRun });
        sendJson(res, result.result === 'refused' ? 409 : 200, result);
      }),
    ],
    [
      'POST',
      OP_ACTION('acknowledge'),
      guarded(async ({ req, res, params }) => {
        const body = await jsonBody(req, acknowledgeBody);
        sendJson(res, 200, await acknowledgeOperation(deps.pool, params[0]!, body.note, actor, body.reviewReason));
      }),
    ],
    [
      'POST',
      '/admin/requeue-stuck',
      guarded(async ({ req, res }) => {
        const body = await jsonBody(req, stuckBody);
        sendJson(res, 200, { results: await requeueStuck(deps.pool, deps.boss, { actor, olderThanSeconds: body.olderThanSeconds, dryRun: !!body.dryRun }) });
      }),
    ],
    [
      'POST',
      '/admin/reconcile',
      guarded(async ({ res }) => {
        const report = await reconcileNow(deps.pool, evidence(), { actor, owner: deps.workerId, leaseTtlMs: deps.config.worker.leaseTtlMs, log: deps.log, processingReviewDays: deps.config.processingReviewDays });
        sendJson(res, 200, report);
      }),
    ],
  ];
}
