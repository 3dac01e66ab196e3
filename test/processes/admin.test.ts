// Admin re-enqueue (invariant 10), the admin HTTP API and the Stripe webhook inbox.
import { randomUUID } from 'node:crypto';
import Stripe from 'stripe';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { reconcileNow } from '../../src/admin/reconcile.ts';
import { requeueOperation, requeueStuck } from '../../src/admin/requeue.ts';
import { createPool } from '../../src/db/pool.ts';
import { loadConfig } from '../../src/runtime/config.ts';
import { adminRoutes } from '../../src/http/admin.ts';
import { startHttpServer, type HttpServer } from '../../src/http/server.ts';
import { webhookRoutes } from '../../src/http/webhooks.ts';
import { DEFAULT_RETENTION_DAYS, pruneHistory } from '../../src/outbox/retention.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { flagDiscrepancy, releaseLease } from '../../src/engine/operation.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher } from '../support/dispatcher.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { chargeJobs, claim, confirm, operation, relay } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

const TOKEN = 'test-admin-token-0123456789';
const WEBHOOK_SECRET = 'whsec_test_outboxd';
/** The connected accounts' endpoint's: Stripe signs it apart from the platform's. */
const CONNECT_WEBHOOK_SECRET = 'whsec_test_outboxd_connect';
const log = createLogger('silent');
let t: TestDb;
let e: RunningEmulator;
let http: HttpServer;
let base: string;
let mismatches = 0;

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  const config = loadConfig({ ADMIN_TOKEN: TOKEN, ADMIN_TOKEN_NAME: 'ops-team', STRIPE_WEBHOOK_SECRET: `${WEBHOOK_SECRET}, ${CONNECT_WEBHOOK_SECRET}` });
  http = await startHttpServer(0, [
    ...adminRoutes({ pool: t.pool, boss: t.boss, gateway: e.gateway(), log, config, workerId: 'admin-test' }),
    ...webhookRoutes({ pool: t.pool, gateway: e.gateway(), log, secrets: config.webhookSecrets, onMismatch: () => mismatches++ }),
  ], '127.0.0.1');
  base = `http://127.0.0.1:${http.port}`;
});
afterAll(async () => {
  await http.close();
  await Promise.all([t.close(), e.close()]);
});
beforeEach(() => e.emulator.reset());

const charges = (op: string) => e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op);
const api = (path: string, init: RequestInit & { token?: string | null } = {}) =>
  fetch(`${base}${path}`, {
    ...init,
    headers: { 'Content-Type': 'application/json', ...(init.token !== null ? { Authorization: `Bearer ${init.token ?? TOKEN}` } : {}) },
  });

describe('requeue (invariant 10)', () => {
  it('a dead-lettered job: requeue gives the same operation a new job, which settles with one charge', async () => {
    const op = await confirm(t);
    await relay(t);
    await t.pool.query(`update pgboss.job set state = 'failed', completed_on = now() where name = 'charge' and data->>'operationId' = $1`, [op]);
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'retries exhausted' where id = $1`, [op]);
    const result = await requeueOperation(t.pool, t.boss, op, { actor: 'alice' });
    expect(result.result).toBe('requeued');
    expect(await chargeJobs(t, op)).toBe(2);
    const replica = await startDispatcher(t, e.gateway(), 'replica-a');
    try {
      await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 20_000, 'settled');
    } finally {
      await replica.stop();
    }
    expect(charges(op)).toHaveLength(1);
    const { rows } = await t.pool.query(`select actor, action from outboxd.admin_audit where operation_id = $1`, [op]);
    expect(rows).toEqual([{ actor: 'alice', action: 'requeue' }]);
  });

  it('skips an operation with a queued job or a live lease, refuses a settled one', async () => {
    const queued = await confirm(t);
    expect(await requeueOperation(t.pool, t.boss, queued, { actor: 'a' })).toMatchObject({ result: 'skipped', reason: expect.stringMatching(/outbox/) });
    await relay(t);
    expect(await requeueOperation(t.pool, t.boss, queued, { actor: 'a' })).toMatchObject({ result: 'skipped', reason: expect.stringMatching(/is created/) });
    await t.pool.query(`delete from pgboss.job where data->>'operationId' = $1`, [queued]);
    const fence = await claim(t, queued);
    expect(await requeueOperation(t.pool, t.boss, queued, { actor: 'a' })).toMatchObject({ result: 'skipped', reason: expect.stringMatching(/leased/) });
    await executeOperation(t.pool, kindsFor(e.gateway()), queued, fence);
    await releaseLease(t.pool, queued, fence);
    expect(await requeueOperation(t.pool, t.boss, queued, { actor: 'a' })).toMatchObject({ result: 'refused', reason: 'operation is succeeded' });
    // Each requeue that did nothing is on the record with why; a dry run is no action, and is not.
    expect(await requeueOperation(t.pool, t.boss, queued, { actor: 'a', dryRun: true })).toMatchObject({ result: 'refused' });
    const { rows } = await t.pool.query(`select actor, action, details from outboxd.admin_audit where operation_id = $1 order by id`, [queued]);
    expect(rows).toEqual([
      { actor: 'a', action: 'requeue_refused', details: { result: 'skipped', reason: expect.stringMatching(/outbox/) } },
      { actor: 'a', action: 'requeue_refused', details: { result: 'skipped', reason: expect.stringMatching(/is created/) } },
      { actor: 'a', action: 'requeue_refused', details: { result: 'skipped', reason: expect.stringMatching(/leased/) } },
      { actor: 'a', action: 'requeue_refused', details: { result: 'refused', reason: 'operation is succeeded' } },
    ]);
  });

  it('--stuck: operations driven quietly (their jobs hours away) do not hide a stuck one behind the limit', async () => {
    const waiting = [await confirm(t), await confirm(t), await confirm(t)];
    await relay(t);
    await t.pool.query(`update pgboss.job set start_after = now() + interval '20 hours' where name = 'charge' and data->>'operationId' = any($1)`, [waiting]);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', updated_at = now() - interval '4 hours' where id = any($1::uuid[])`, [waiting]);
    const stuck = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [stuck]);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', updated_at = now() - interval '1 hour' where id = $1`, [stuck]);
    const results = await requeueStuck(t.pool, t.boss, { actor: 'ops', olderThanSeconds: 600, limit: waiting.length, dryRun: true });
    expect(results.find((r) => r.operationId === stuck)).toEqual({ operationId: stuck, result: 'would_requeue' });
    expect(results.filter((r) => waiting.includes(r.operationId))).toEqual([]);
  });

  it('--stuck: an operation that settles after it was listed is skipped, not refused (which exits 2)', async () => {
    const op = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    // Its requeue waits on this lock while the operation settles.
    const held = await t.pool.connect();
    try {
      await held.query('begin');
      await held.query(`select pg_advisory_xact_lock(hashtextextended('outboxd-requeue:' || $1, 0))`, [op]);
      const stuck = requeueStuck(t.pool, t.boss, { actor: 'x', olderThanSeconds: 0 });
      await waitUntil(async () => {
        const { rows } = await t.pool.query(`select count(*)::int as n from pg_locks where locktype = 'advisory' and not granted and database = (select oid from pg_database where datname = current_database())`);
        return rows[0].n > 0;
      }, 10_000, 'the requeue waits for the lock');
      await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now() where id = $1`, [op]);
      await held.query('commit');
      expect((await stuck).find((r) => r.operationId === op)).toEqual({ operationId: op, result: 'skipped', reason: 'settled since it was listed (operation is succeeded)' });
    } finally {
      held.release();
    }
  });

  it('concurrent requeues beside running workers never make a second charge', async () => {
    e.emulator.addFault({ fault: { kind: 'latency', ms: 30 }, count: Infinity });
    const ops = await Promise.all(Array.from({ length: 40 }, () => confirm(t)));
    // The jobs are lost: every operation needs a requeue, and the requeues race each other.
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = any($1)`, [ops]);
    const replicas = await Promise.all([startDispatcher(t, e.gateway(), 'r1'), startDispatcher(t, e.gateway(), 'r2')]);
    try {
      for (let round = 0; round < 5; round++) {
        await Promise.all([
          requeueStuck(t.pool, t.boss, { actor: 'x', olderThanSeconds: 0 }),
          requeueStuck(t.pool, t.boss, { actor: 'y', olderThanSeconds: 0 }),
          ...ops.slice(0, 10).map((op) => requeueOperation(t.pool, t.boss, op, { actor: 'z' })),
        ]);
      }
      await waitUntil(async () => {
        const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where id = any($1) and status = 'succeeded'`, [ops]);
        return rows[0].n === ops.length;
      }, 40_000, 'all settled');
    } finally {
      await Promise.all(replicas.map((r) => r.stop()));
    }
    for (const op of ops) {
      expect(charges(op)).toHaveLength(1);
      expect(await chargeJobs(t, op)).toBe(1); // one live job at a time: the racing requeues made one
    }
  });
});

describe('admin HTTP API', () => {
  it('refuses a missing token (401) and a wrong one (403)', async () => {
    expect((await api('/admin/operations', { token: null })).status).toBe(401);
    expect((await api('/admin/operations', { token: 'wrong-token-wrong-token' })).status).toBe(403);
    const ok = await api('/admin/operations?needs_review=true');
    expect(ok.status).toBe(200);
    expect(await ok.json()).toHaveProperty('operations');
  });

  it('does not exist when no ADMIN_TOKEN is configured', async () => {
    const server = await startHttpServer(0, adminRoutes({ pool: t.pool, boss: t.boss, gateway: e.gateway(), log, config: loadConfig({}), workerId: 'w' }), '127.0.0.1');
    try {
      expect((await fetch(`http://127.0.0.1:${server.port}/admin/operations`, { headers: { Authorization: 'Bearer anything' } })).status).toBe(404);
    } finally {
      await server.close();
    }
  });

  it('a replica whose emulator knows only its own charges refuses to resolve or reconcile (no evidence)', async () => {
    const config = loadConfig({ ADMIN_TOKEN: TOKEN });
    const server = await startHttpServer(0, adminRoutes({ pool: t.pool, boss: t.boss, gateway: undefined, log, config, workerId: 'w' }), '127.0.0.1');
    try {
      const op = await confirm(t);
      const call = (path: string, body: unknown) =>
        fetch(`http://127.0.0.1:${server.port}${path}`, { method: 'POST', headers: { Authorization: `Bearer ${TOKEN}`, 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
      const resolved = await call(`/admin/operations/${op}/resolve`, { outcome: 'failed', reason: 'x' });
      expect(resolved.status).toBe(409);
      expect(await resolved.json()).toMatchObject({ error: 'no_evidence', message: expect.stringMatching(/STRIPE_SECRET_KEY/) });
      expect((await call('/admin/reconcile', {})).status).toBe(409);
      expect((await operation(t, op)).status).toBe('pending');
    } finally {
      await server.close();
    }
  });

  it('a sweep a person asked for that fails part way is on the record too, saying why', async () => {
    // Its database stops answering in time, after it read its candidates: another session holds pg-boss's jobs.
    const impatient = createPool(t.url, { schema: t.schema, max: 2, queryTimeoutMs: 500 });
    const holder = await t.pool.connect();
    try {
      await holder.query('begin');
      await holder.query('lock table pgboss.job in access exclusive mode');
      await expect(reconcileNow(impatient, e.gateway(), { actor: 'carol', owner: 'admin:carol', leaseTtlMs: 10_000, log: createLogger('silent') })).rejects.toThrow(/timeout/);
    } finally {
      await holder.query('rollback');
      holder.release();
      await impatient.end();
    }
    const { rows } = await t.pool.query(`select details from outboxd.admin_audit where action = 'reconcile' and actor = 'carol'`);
    expect(rows).toEqual([{ details: { failed: expect.stringMatching(/timeout/) } }]);
  });

  it('404 for an unknown operation, 422 for bad input', async () => {
    expect((await api('/admin/operations/3f2504e0-4f89-41d3-9a0c-0305e82c3301')).status).toBe(404);
    expect((await api('/admin/operations/not-a-uuid')).status).toBe(422);
    expect((await api('/admin/operations?status=bogus')).status).toBe(422);
    const op = await confirm(t);
    const bad = await api(`/admin/operations/${op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: 'ch_1' }) });
    expect(bad.status).toBe(422);
    expect(await bad.json()).toMatchObject({ error: 'invalid_input', message: expect.stringMatching(/externalId/) });
    expect((await api(`/admin/operations/${op}/resolve`, { method: 'POST', body: '{' })).status).toBe(422);
    // A pi_ Stripe does not have (a typo) is a refusal that says so, not a fault of outboxd's.
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    const typo = await api(`/admin/operations/${op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: 'pi_typo123' }) });
    expect(typo.status).toBe(422);
    expect(await typo.json()).toMatchObject({ error: 'refused', message: expect.stringMatching(/Stripe refused to show it .*No such payment_intent/) });
    const { rows } = await t.pool.query(`select action, details->>'externalId' as tried, details->>'refused' as refused from outboxd.admin_audit where operation_id = $1 order by id`, [op]);
    expect(rows).toEqual([
      { action: 'resolve_refused', tried: 'ch_1', refused: expect.stringMatching(/externalId: must be/) },
      { action: 'resolve_refused', tried: 'pi_typo123', refused: expect.stringMatching(/No such payment_intent/) },
    ]);
  });

  it('lists every column, a long JSON value as its size (the operation itself gives it whole), up to 1000 a page', async () => {
    const big = { blob: 'x'.repeat(60_000) };
    const { rows } = await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, payload, result, status)
       values ('bulky_listed', 'at-least-once', 'k1', $1::jsonb, '{"ok": true}', 'unknown') returning id`,
      [JSON.stringify(big)],
    );
    const { operations } = (await (await api('/admin/operations?status=unknown&limit=1000')).json()) as { operations: { id: string }[] };
    const listed = operations.find((o) => o.id === rows[0].id);
    expect(listed).toMatchObject({ kind: 'bulky_listed', payload: { omitted_bytes: JSON.stringify(big).length + 1 }, result: { ok: true }, metadata: {} });
    expect(((await (await api(`/admin/operations/${rows[0].id}`)).json()) as { payload: unknown }).payload).toEqual(big);
    expect((await api('/admin/operations?limit=1001')).status).toBe(422);
    const newest = (await (await api('/admin/operations?order=newest&limit=1')).json()) as { operations: { id: string }[] };
    expect(newest.operations.map((o) => o.id)).toEqual([rows[0].id]); // the last inserted
    expect((await api('/admin/operations?order=random')).status).toBe(422);
    await t.pool.query(`delete from outboxd.payment_operations where id = $1`, [rows[0].id]);
  });

  it('resolves with evidence, audited under the token’s name; requeues and reconciles', async () => {
    const op = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', review_reason = 'checked by hand' where id = $1`, [op]);
    const pi = await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
    const res = await api(`/admin/operations/${op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: pi.id }) });
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ status: 'succeeded', external_id: pi.id });
    const { rows } = await t.pool.query(`select actor from outboxd.admin_audit where operation_id = $1`, [op]);
    expect(rows).toEqual([{ actor: 'token:ops-team' }]);
    expect((await api(`/admin/operations/${op}/requeue`, { method: 'POST', body: '{}' })).status).toBe(409);
    const sweep = await api('/admin/reconcile', { method: 'POST' });
    expect(sweep.status).toBe(200);
    expect(await sweep.json()).toHaveProperty('examined');
    // The captures and cancels it recorded (each with its settlement event) are on the record too.
    const audited = await t.pool.query(`select details from outboxd.admin_audit where action = 'reconcile' order by id desc limit 1`);
    expect(audited.rows[0].details).toMatchObject({ examined: expect.any(Number), followedUp: [] });
  });
  it('a resolution answers a discrepancy (a second charge) only when the person said they read it: without the reason read it stays held, with a stale one it is refused', async () => {
    const held = async () => {
      const op = await confirm(t);
      const own = await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op } });
      await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
      await t.pool.query(`update outboxd.payment_operations set status = 'unknown', external_id = $2, review_reason = 'retries exhausted' where id = $1`, [op, own.id]);
      const read = ((await (await api(`/admin/operations/${op}`)).json()) as { review_reason: string }).review_reason;
      // A second charge's webhook arrives after the person read the operation.
      await flagDiscrepancy(t.pool, op, `webhook payment_intent.succeeded: pi_second is not the operation's charge ${own.id}`);
      return { op, own, read, now: (await operation(t, op)).review_reason! };
    };
    const unread = await held();
    const res = await api(`/admin/operations/${unread.op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: unread.own.id }) });
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ status: 'succeeded', needs_review: true, review_reason: unread.now });
    const stale = await held();
    const refused = await api(`/admin/operations/${stale.op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: stale.own.id, reviewReason: stale.read }) });
    expect(refused.status).toBe(422);
    expect(await refused.json()).toMatchObject({ message: expect.stringContaining('changed since it was read') });
    const seen = await api(`/admin/operations/${stale.op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: stale.own.id, reviewReason: stale.now }) });
    expect(await seen.json()).toMatchObject({ status: 'succeeded', needs_review: false, review_reason: null });
  });
});

describe('Stripe webhook inbox', () => {
  const signed = (payload: string, secret = WEBHOOK_SECRET) => ({
    method: 'POST',
    headers: { 'Content-Type': 'application/json', 'Stripe-Signature': Stripe.webhooks.generateTestHeaderString({ payload, secret }) },
    body: payload,
  });

  it('settles an unknown operation before any retry; the retry then makes no call', async () => {
    e.emulator.configureWebhooks({ url: `${base}/webhooks/stripe`, secret: WEBHOOK_SECRET, delayMs: 300 });
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    expect((await executeOperation(t.pool, kindsFor(e.gateway()), op, fence)).operation.status).toBe('unknown');
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 5_000, 'webhook settles');
    expect((await operation(t, op)).external_id).toBe(charges(op)[0]!.paymentIntent.id);
    const requestsBefore = e.emulator.requests().length;
    const next = await claim(t, op).catch(() => undefined);
    expect(next).toBeUndefined(); // settled: no claim, so no call
    expect(e.emulator.requests()).toHaveLength(requestsBefore);
  });

  it('a duplicate delivery is acknowledged and not reprocessed', async () => {
    e.emulator.configureWebhooks({ url: `${base}/webhooks/stripe`, secret: WEBHOOK_SECRET });
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const pi = charges(op)[0]!.paymentIntent;
    e.emulator.settle(pi.id, 'succeeded');
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 5_000, 'webhook settles');
    const event = e.emulator.emittedEvents().find((ev) => ev.type === 'payment_intent.succeeded')!;
    // Whichever event was processed first settled it (each is checked by retrieving the PaymentIntent);
    // every event about its PaymentIntent (its processing one too, which may come last) is recorded first.
    const about = e.emulator.emittedEvents().filter((ev) => ev.data.object.id === pi.id).map((ev) => ev.id);
    await waitUntil(async () => (await t.pool.query(`select 1 from outboxd.webhook_events where id = any($1)`, [about])).rows.length === about.length, 5_000, 'recorded');
    const before = (await t.pool.query(`select id, result from outboxd.webhook_events where operation_id = $1 order by id`, [op])).rows;
    expect(before.filter((r) => r.result === 'settled').map((r) => r.id)).toHaveLength(1);
    expect(await e.emulator.redeliver(event.id)).toBe(200);
    expect((await t.pool.query(`select id, result from outboxd.webhook_events where operation_id = $1 order by id`, [op])).rows).toEqual(before);
    const replay = await fetch(`${base}/webhooks/stripe`, signed(JSON.stringify(event)));
    expect(await replay.json()).toEqual({ received: true, result: 'duplicate' });
  });

  it("an event of the connected accounts' endpoint, signed with its own secret, is received as the platform's", async () => {
    e.emulator.configureWebhooks({ url: `${base}/webhooks/stripe`, secret: CONNECT_WEBHOOK_SECRET });
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    e.emulator.settle(charges(op)[0]!.paymentIntent.id, 'succeeded');
    await waitUntil(async () => (await operation(t, op)).status === 'succeeded', 5_000, 'webhook settles');
    expect((await t.pool.query(`select result from outboxd.webhook_events where operation_id = $1 and result = 'settled'`, [op])).rows).toHaveLength(1);
  });

  it('a forged signature is refused with 400 and nothing is stored', async () => {
    const op = await confirm(t);
    const forged = JSON.stringify({ id: 'evt_forged', object: 'event', type: 'payment_intent.succeeded', data: { object: { id: 'pi_x', amount: 2599, currency: 'eur', metadata: { operation_id: op } } } });
    const res = await fetch(`${base}/webhooks/stripe`, signed(forged, 'whsec_someone_else'));
    expect(res.status).toBe(400);
    expect((await t.pool.query(`select 1 from outboxd.webhook_events where id = 'evt_forged'`)).rows).toHaveLength(0);
    expect((await operation(t, op)).status).toBe('pending');
  });

  const eventFor = (id: string, pi: Record<string, unknown>, type = 'payment_intent.succeeded') =>
    JSON.stringify({ id, object: 'event', type, created: 1_700_000_000, livemode: false, data: { object: pi } });
  const createPi = (op: string, over: Record<string, unknown> = {}) =>
    e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op }, ...over });
  /** As if a worker sent the operation's create and its answer was lost: a PaymentIntent naming it may be its own. */
  const sentUnanswered = (op: string) =>
    t.pool.query(`update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now(), last_attempted_at = now() where id = $1`, [op]);

  it('metadata naming an operation is anyone’s to write: a PaymentIntent outboxd never sent, another customer’s, or another operation’s own, settles nothing and is flagged', async () => {
    const before = mismatches;
    // Never sent: a dashboard user's (or a connected account's) PaymentIntent naming a pending charge would
    // tell the application it was paid, and the worker would then never charge.
    const pending = await confirm(t);
    const made = await createPi(pending);
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_never_sent', { id: made.id })))).json()).toEqual({ received: true, result: 'mismatch' });
    expect(await operation(t, pending)).toMatchObject({ status: 'pending', external_id: null, review_reason: expect.stringMatching(/which outboxd has not sent to Stripe/) });
    // Declined, it would have said failed.
    const declined = await confirm(t);
    const refusedPi = await e.client().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_chargeDeclined', confirm: true, metadata: { operation_id: declined } }).catch((err) => err.raw.payment_intent);
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_never_sent_declined', { id: refusedPi.id }, 'payment_intent.payment_failed')))).json()).toEqual({ received: true, result: 'mismatch' });
    expect((await operation(t, declined)).status).toBe('pending');
    // Sent and unanswered, the same amount, but another customer's.
    const unanswered = await confirm(t);
    await sentUnanswered(unanswered);
    const elsewhere = await createPi(unanswered, { customer: 'cus_someone_else' });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_other_customer', { id: elsewhere.id })))).json()).toEqual({ received: true, result: 'mismatch' });
    expect(await operation(t, unanswered)).toMatchObject({ status: 'unknown', review_reason: expect.stringMatching(/charges cus_someone_else; the operation's customer is cus_test_1/) });
    // Another operation's own PaymentIntent, its metadata edited since to name this one (as the dashboard
    // or its connected account can): recorded as the first's, naming the second.
    const [first, second] = [await confirm(t), await confirm(t)];
    await sentUnanswered(second);
    const firstPi = await createPi(second);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', external_id = $2, settled_at = now() where id = $1`, [first, firstPi.id]);
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_repointed', { id: firstPi.id })))).json()).toEqual({ received: true, result: 'mismatch' });
    expect(await operation(t, second)).toMatchObject({ status: 'unknown', external_id: null, review_reason: expect.stringContaining(`${firstPi.id} is operation ${first}'s payment intent, not ${second}'s`) });
    // Search finds it the same way: the operation goes to a person, not settled by it.
    await t.pool.query(`update outboxd.payment_operations set review_reason = null, first_attempted_at = now() - interval '2 days' where id = $1`, [second]);
    const searched = await executeOperation(t.pool, kindsFor(e.gateway()), second, await claim(t, second));
    expect(searched).toMatchObject({ call: 'search', operation: { status: 'unknown', external_id: null, review_reason: `${firstPi.id} is operation ${first}'s payment intent, not ${second}'s` } });
    // Nor does a person's resolution naming it.
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [second]);
    const resolved = await api(`/admin/operations/${second}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'succeeded', externalId: firstPi.id }) });
    expect(await resolved.json()).toMatchObject({ error: 'refused', message: `${firstPi.id} is operation ${first}'s payment intent, not ${second}'s; it cannot settle this operation` });
    expect(mismatches).toBe(before + 4);
  });

  it('a PaymentIntent whose amount does not match flags the operation for review, counted, and settles nothing', async () => {
    const op = await confirm(t);
    const pi = await createPi(op, { amount: 1 });
    const before = mismatches;
    // The event itself claims the right amount: only the retrieved PaymentIntent counts.
    const event = eventFor('evt_mismatch', { id: pi.id, amount: 2599, currency: 'eur', metadata: { operation_id: op } });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(event))).json()).toEqual({ received: true, result: 'mismatch' });
    expect(await operation(t, op)).toMatchObject({ status: 'pending', needs_review: true, review_reason: expect.stringMatching(/is 1 eur/) });
    expect(mismatches).toBe(before + 1);
  });

  it('an event is a hint: a "succeeded" event for a PaymentIntent still processing settles nothing', async () => {
    const op = await confirm(t);
    await sentUnanswered(op);
    const pi = await createPi(op, { payment_method: 'pm_card_processing' });
    const event = eventFor('evt_claims_success', { id: pi.id, status: 'succeeded', amount: 2599, currency: 'eur', metadata: { operation_id: op } });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(event))).json()).toEqual({ received: true, result: 'not_final' });
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', review_reason: null });
  });

  it('a PaymentIntent other than the operation\'s known charge is a mismatch, not a settlement', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const stray = await createPi(op);
    const event = eventFor('evt_stray', { id: stray.id });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(event))).json()).toEqual({ received: true, result: 'mismatch' });
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', needs_review: true, review_reason: expect.stringMatching(/not the operation's charge/) });
  });

  it('an event that only confirms a settled operation is acknowledged without a retrieve (no Stripe token spent); one that disagrees is retrieved', async () => {
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const pi = charges(op)[0]!.paymentIntent;
    const retrieves = () => e.emulator.requests().filter((r) => r.endpoint === 'retrieve').length;
    const before = retrieves();
    const agrees = eventFor('evt_confirms', { id: pi.id, object: 'payment_intent', status: 'succeeded', amount: pi.amount, currency: pi.currency, metadata: { operation_id: op } });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(agrees))).json()).toEqual({ received: true, result: 'already_settled' });
    expect(retrieves()).toBe(before);
    // The same object said to have failed: Stripe is asked, and its answer (succeeded) counts.
    const disagrees = eventFor('evt_disagrees', { id: pi.id, object: 'payment_intent', status: 'canceled', metadata: { operation_id: op } }, 'payment_intent.canceled');
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(disagrees))).json()).toEqual({ received: true, result: 'already_settled' });
    expect(retrieves()).toBe(before + 1);
    expect((await operation(t, op)).status).toBe('succeeded');
  });

  it('a charge that contradicts a failed operation is counted and holds it for review as it settled, until a person acknowledges it', async () => {
    const op = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where id = $1`, [op]);
    const pi = await createPi(op);
    const before = mismatches;
    const res = await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_contradiction', { id: pi.id })));
    expect(await res.json()).toEqual({ received: true, result: 'contradiction' });
    expect(mismatches).toBe(before + 1);
    const reason = `discrepancy with Stripe: webhook payment_intent.succeeded: ${pi.id} is succeeded, the operation failed`;
    expect(await operation(t, op)).toMatchObject({ status: 'failed', needs_review: true, review_reason: reason });
    // Resolving it is for unsettled operations; a person acknowledges it once dealt with in Stripe.
    expect((await api(`/admin/operations/${op}/resolve`, { method: 'POST', body: JSON.stringify({ outcome: 'failed', reason: 'x' }) })).status).toBe(422);
    expect((await api(`/admin/operations/${op}/acknowledge`, { method: 'POST', body: JSON.stringify({ note: ' ', reviewReason: reason }) })).status).toBe(422);
    expect((await api(`/admin/operations/${op}/acknowledge`, { method: 'POST', body: '{"note":"no reason named"}' })).status).toBe(422);
    // A second charge flagged after the person read the reason: added to it, and their acknowledgement refused.
    const second = await createPi(op);
    await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_contradiction_2', { id: second.id })));
    const both = `${reason} | webhook payment_intent.succeeded: ${second.id} is succeeded, the operation failed`;
    expect((await operation(t, op)).review_reason).toBe(both);
    const stale = await api(`/admin/operations/${op}/acknowledge`, { method: 'POST', body: JSON.stringify({ note: `refunded ${pi.id}`, reviewReason: reason }) });
    expect(await stale.json()).toMatchObject({ error: 'refused', message: expect.stringContaining(`changed since it was read: read it again: ${both}`) });
    const acked = await api(`/admin/operations/${op}/acknowledge`, { method: 'POST', body: JSON.stringify({ note: `refunded ${pi.id} and ${second.id} in the dashboard`, reviewReason: both }) });
    expect(acked.status).toBe(200);
    expect(await acked.json()).toMatchObject({ id: op, status: 'failed', needs_review: false, review_reason: null });
    const { rows } = await t.pool.query(`select actor, action, details from outboxd.admin_audit where operation_id = $1 and action = 'acknowledge'`, [op]);
    expect(rows).toEqual([{ actor: 'token:ops-team', action: 'acknowledge', details: { note: `refunded ${pi.id} and ${second.id} in the dashboard`, reviewReason: both, status: 'failed' } }]);
    const again = await api(`/admin/operations/${op}/acknowledge`, { method: 'POST', body: JSON.stringify({ note: 'twice', reviewReason: both }) });
    expect(again.status).toBe(422);
    expect(await again.json()).toMatchObject({ error: 'refused', message: expect.stringMatching(/not held for review/) });
    const unsettled = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'checked by hand' where id = $1`, [unsettled]);
    const refused = await api(`/admin/operations/${unsettled}/acknowledge`, { method: 'POST', body: '{"note":"x","reviewReason":"checked by hand"}' });
    expect(await refused.json()).toMatchObject({ error: 'refused', message: expect.stringMatching(/is pending: an unsettled operation is resolved/) });
    // Each refusal is on the record, with who tried and why it stood.
    const refusals = await t.pool.query(`select operation_id, details->>'note' as note, details->>'refused' as refused from outboxd.admin_audit where action = 'acknowledge_refused' and operation_id = any($1::uuid[]) order by id`, [[op, unsettled]]);
    expect(refusals.rows).toEqual([
      { operation_id: op, note: `refunded ${pi.id}`, refused: expect.stringMatching(/changed since it was read/) },
      { operation_id: op, note: 'twice', refused: expect.stringMatching(/not held for review/) },
      { operation_id: unsettled, note: 'x', refused: expect.stringMatching(/is pending/) },
    ]);
  });

  it('a second PaymentIntent carrying the operation\'s id keeps it held for review when its own charge settles it', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const own = charges(op)[0]!.paymentIntent;
    const stray = await createPi(op);
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_second_charge', { id: stray.id })))).json()).toEqual({ received: true, result: 'mismatch' });
    // Its own charge settles it, and it stays held: the stray charge is money it does not account for.
    e.emulator.settle(own.id, 'succeeded');
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_own_charge', { id: own.id })))).json()).toEqual({ received: true, result: 'settled' });
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', needs_review: true, review_reason: `discrepancy with Stripe: webhook payment_intent.succeeded: ${stray.id} is not the operation's charge ${own.id}` });
    // So is one settled by a worker's outcome.
    const other = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await executeOperation(t.pool, kindsFor(e.gateway()), other, await claim(t, other));
    const second = await createPi(other);
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_second_charge_2', { id: second.id })))).json()).toEqual({ received: true, result: 'mismatch' });
    e.emulator.settle(charges(other)[0]!.paymentIntent.id, 'succeeded');
    await t.pool.query(`update outboxd.payment_operations set lease_expires_at = null where id = $1`, [other]);
    await executeOperation(t.pool, kindsFor(e.gateway()), other, await claim(t, other));
    expect(await operation(t, other)).toMatchObject({ status: 'succeeded', needs_review: true, review_reason: expect.stringMatching(/^discrepancy with Stripe: /) });
  });

  it('an event whose object names no operation of ours (the application’s other payments, a connected account’s own) is recorded without a retrieve: it spends none of the fleet’s Stripe budget, which the dispatcher’s charges wait on', async () => {
    const unnamed = await e.client().paymentIntents.create({ amount: 900, currency: 'eur', payment_method: 'pm_card_visa', confirm: true });
    const unknownOp = await createPi(randomUUID());
    const notAnId = await createPi('order-17');
    const retrieves = () => e.emulator.requests().filter((r) => r.endpoint === 'retrieve').length;
    const before = retrieves();
    for (const [i, pi] of [unnamed, unknownOp, notAnId].entries()) {
      expect(await (await fetch(`${base}/webhooks/stripe`, signed(eventFor(`evt_not_ours_${i}`, pi as unknown as Record<string, unknown>)))).json()).toEqual({ received: true, result: 'no_operation' });
    }
    expect(retrieves()).toBe(before);
  });

  it('an event naming a PaymentIntent Stripe does not show (404) is acknowledged, not retried forever', async () => {
    const res = await fetch(`${base}/webhooks/stripe`, signed(eventFor('evt_elsewhere', { id: 'pi_not_ours' })));
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ received: true, result: 'no_operation' });
  });

  it('stores ids, type, times and the PaymentIntent\'s id and status only; pruned after the retention', async () => {
    const op = await confirm(t);
    await sentUnanswered(op);
    const pi = await createPi(op);
    const event = eventFor('evt_trimmed', { id: pi.id, payment_method: 'pm_card_visa', billing_details: { name: 'A Person' }, metadata: { operation_id: op } });
    expect(await (await fetch(`${base}/webhooks/stripe`, signed(event))).json()).toEqual({ received: true, result: 'settled' });
    const { rows } = await t.pool.query(`select payload from outboxd.webhook_events where id = 'evt_trimmed'`);
    expect(rows[0].payload).toEqual({ id: 'evt_trimmed', type: 'payment_intent.succeeded', created: 1_700_000_000, livemode: false, payment_intent: { id: pi.id, status: 'succeeded' } });
    await t.pool.query(`update outboxd.webhook_events set received_at = now() - interval '31 days' where id = 'evt_trimmed'`);
    // One about an operation held for review is its evidence, kept as its timeline is; so is one about an
    // operation still unsettled.
    const held = await confirm(t);
    const unsettled = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() - interval '60 days', review_reason = 'discrepancy with Stripe: checked by hand' where id = $1`, [held]);
    await t.pool.query(
      `insert into outboxd.webhook_events (id, type, operation_id, received_at, result, payload)
       values ('evt_evidence', 'payment_intent.succeeded', $1, now() - interval '31 days', 'contradiction', '{}'),
              ('evt_pending', 'payment_intent.processing', $2, now() - interval '31 days', 'not_final', '{}')`,
      [held, unsettled],
    );
    expect((await pruneHistory(t.pool, DEFAULT_RETENTION_DAYS)).webhookEvents).toBeGreaterThanOrEqual(1);
    expect((await t.pool.query(`select id from outboxd.webhook_events where id like 'evt_%' and received_at < now() - interval '30 days' order by id`)).rows).toEqual([{ id: 'evt_evidence' }, { id: 'evt_pending' }]);
    // Acknowledged (settled long ago), its evidence goes as the rest does.
    await t.pool.query(`update outboxd.payment_operations set review_reason = null where id = $1`, [held]);
    await pruneHistory(t.pool, DEFAULT_RETENTION_DAYS);
    expect((await t.pool.query(`select id from outboxd.webhook_events where id in ('evt_evidence', 'evt_pending')`)).rows).toEqual([{ id: 'evt_pending' }]);
  });

  it('keeps them at least 4 days: Stripe retries a webhook for 3, and a shorter memory takes a late retry for a new event', () => {
    expect(() => loadConfig({ WEBHOOK_RETENTION_DAYS: '3' })).toThrow(/WEBHOOK_RETENTION_DAYS/);
    expect(loadConfig({ WEBHOOK_RETENTION_DAYS: '4' }).retentionDays.webhookEvents).toBe(4);
  });
});
