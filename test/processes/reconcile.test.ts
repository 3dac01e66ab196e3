// Reconciliation past the key window, the drift report and review resolution, over the real SDK.
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { ResolutionRefused, resolveOperation, type Resolution } from '../../src/admin/resolve.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { executeOperation } from '../../src/engine/executor.ts';
import { kindsFor } from '../../src/kinds/index.ts';
import { claimOperation, flagDiscrepancy, releaseLease } from '../../src/engine/operation.ts';
import { driftReport } from '../../src/reconcile/drift.ts';
import { reconcileSweep } from '../../src/reconcile/sweep.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { claim, confirm, operation, relay } from '../support/fixtures.ts';
import { waitUntil } from '../../harness/replica.ts';

let t: TestDb;
let e: RunningEmulator;
const log = createLogger('silent');
beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
});
beforeEach(async () => {
  e.emulator.reset();
  // Each test looks at its own operations only: settle everything earlier tests left unsettled.
  await t.pool.query(`update outboxd.payment_operations set status = 'failed', settled_at = now() where status in ('pending', 'unknown')`);
});

const sweep = () => reconcileSweep(t.pool, e.gateway(), { owner: 'sweeper', leaseTtlMs: 10_000, log });
const RESOLVE = { leaseTtlMs: 10_000, searchFreshnessSeconds: 3_600 };
const resolve = (op: string, resolution: Resolution, actor = 'alice', gw = e.gateway()) =>
  resolveOperation(t.pool, gw, op, resolution, actor, RESOLVE);
const stripe = () => e.client();
const charges = (op: string) => e.emulator.ledger().filter((l) => l.paymentIntent.metadata.operation_id === op);
/** An operation whose call went out, lost its answer, and whose key window has since passed; its job is
 * gone (the outbox row relayed, the job dead-lettered). */
async function lostPastWindow(overrides: Parameters<typeof confirm>[1] = {}): Promise<string> {
  const op = await confirm(t, overrides);
  await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
  await t.pool.query(
    `update outboxd.payment_operations set status = 'unknown', attempts = 1, first_attempted_at = now() - interval '25 hours',
       last_attempted_at = now() - interval '25 hours' where id = $1`,
    [op],
  );
  return op;
}
const chargeFor = (op: string, over: { amount?: number; payment_method?: string } = {}) =>
  stripe()
    .paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: op }, ...over })
    .catch(() => undefined);

describe('reconcile sweep (past the key window)', () => {
  it('one match succeeded → succeeded with its id; one match requires_payment_method → failed', async () => {
    const paid = await lostPastWindow();
    const declined = await lostPastWindow({ paymentMethod: 'pm_card_chargeDeclined' });
    const pi = await chargeFor(paid);
    await chargeFor(declined, { payment_method: 'pm_card_chargeDeclined' });
    const report = await sweep();
    expect(report).toMatchObject({ examined: 2, settled: 2 });
    expect(await operation(t, paid)).toMatchObject({ status: 'succeeded', external_id: pi!.id });
    expect((await operation(t, declined)).status).toBe('failed');
    expect(e.emulator.requests().filter((r) => r.endpoint === 'create')).toHaveLength(2); // ours only: no create by the sweep
  });

  it('zero matches → unknown, held for review (never "not charged")', async () => {
    const op = await lostPastWindow();
    await sweep();
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', needs_review: true });
  });

  it('two matches → review, with both charges named', async () => {
    const op = await lostPastWindow();
    const [a, b] = [await chargeFor(op), await chargeFor(op)];
    await sweep();
    const held = await operation(t, op);
    expect(held).toMatchObject({ status: 'unknown', needs_review: true, external_id: null });
    expect(held.review_reason).toContain(a!.id);
    expect(held.review_reason).toContain(b!.id);
  });

  it('search lag: found only once the index catches up', async () => {
    e.emulator.configureSearch({ lagMs: 120_000 });
    const op = await lostPastWindow();
    await chargeFor(op);
    await sweep();
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', needs_review: true });
    e.emulator.advanceClock(120_000);
    await sweep();
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', needs_review: false });
  });

  it('pages through more than 100 matches before deciding', async () => {
    const op = await lostPastWindow();
    for (let i = 0; i < 101; i++) await chargeFor(op);
    await sweep();
    expect((await operation(t, op)).review_reason).toMatch(/found 101 charges/);
    expect(e.emulator.requests().filter((r) => r.endpoint === 'search')).toHaveLength(2);
  });

  it('leaves operations inside the window to the dispatcher, and retrieves known charges', async () => {
    const inside = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'unknown', first_attempted_at = now() where id = $1`, [inside]);
    const known = await confirm(t, { paymentMethod: 'pm_card_processing' });
    const fence = await claim(t, known);
    await executeOperation(t.pool, kindsFor(e.gateway()), known, fence);
    await releaseLease(t.pool, known, fence); // a live lease would (rightly) keep the sweep away
    const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === known)!.paymentIntent;
    e.emulator.settle(pi.id, 'succeeded');
    const report = await sweep();
    expect(report.decisions.map((d) => [d.operationId, d.call])).toEqual([[known, 'retrieve']]);
    expect((await operation(t, inside)).status).toBe('unknown');
    expect((await operation(t, known)).status).toBe('succeeded');
  });
});

describe('drift report', () => {
  it('finds the extra charge of a pruned-key resend, an orphan, and a succeeded operation without its charge', async () => {
    const since = new Date(Date.now() - 60_000);
    const op = await confirm(t);
    const fence = await claim(t, op);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'truncate' } });
    await executeOperation(t.pool, kindsFor(e.gateway()), op, fence);
    e.emulator.pruneKeys(); // Stripe forgot the key early: the resend charges again
    await executeOperation(t.pool, kindsFor(e.gateway()), op, fence);
    const orphan = await chargeFor('00000000-0000-4000-8000-000000000000');
    const missing = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = 'pi_doesnotexist' where id = $1`, [missing]);

    // One PaymentIntent recorded by two operations (its metadata edited from one to the other in time).
    const [payer, twin] = [await confirm(t), await confirm(t)];
    const shared = await chargeFor(payer);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = $2 where id = any($1::uuid[])`, [[payer, twin], shared!.id]);

    const report = await driftReport(t.pool, e.gateway(), since);
    const kinds = report.drift.map((d) => [d.kind, d.operationId]);
    expect(report.drift.filter((d) => d.kind === 'shared_charge')).toEqual([
      { kind: 'shared_charge', operationId: expect.stringMatching(new RegExp(`^(${payer}|${twin})$`)), chargeIds: [shared!.id], detail: expect.stringMatching(/records this PaymentIntent too: one charge for two operations/) },
    ]);
    expect(kinds).toContainEqual(['duplicate_charge', op]);
    expect(kinds).toContainEqual(['orphan_charge', '00000000-0000-4000-8000-000000000000']);
    expect(kinds).toContainEqual(['missing_charge', missing]);
    expect(report.drift.find((d) => d.kind === 'orphan_charge')!.chargeIds).toEqual([orphan!.id]);
  });

  it('no drift for a clean run', async () => {
    const since = new Date(Date.now() - 1000);
    await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 day' where settled_at >= $1`, [since]);
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    expect((await driftReport(t.pool, e.gateway(), since)).drift).toEqual([]);
  });

  it('a retrieve that fails (a 5xx, no budget token) fails the report instead of calling the charge missing', async () => {
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    // Settled inside the window, its PaymentIntent made before it: not listed, so retrieved.
    const since = new Date(Date.now() + 60_000);
    await t.pool.query(`update outboxd.payment_operations set settled_at = $2 where id = $1`, [op, new Date(since.getTime() + 1_000)]);
    try {
      e.emulator.addFault({ endpoint: 'retrieve', fault: { kind: 'error_before_commit', status: 500 } });
      await expect(driftReport(t.pool, e.gateway(), since)).rejects.toThrow();
      e.emulator.clearFaults();
      expect((await driftReport(t.pool, e.gateway(), since)).drift).toEqual([]);
    } finally {
      await t.pool.query(`update outboxd.payment_operations set settled_at = now() - interval '1 day' where id = $1`, [op]);
    }
  });

  it('reads the succeeded operations a page at a time: each of 2,001 settled at the same instant compared once', async () => {
    const since = new Date(Date.now() + 120_000);
    const at = new Date(since.getTime() + 1_000);
    const { rows } = await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, order_id, amount, currency, customer_id, payment_method, status, external_id, settled_at)
       select 'charge', 'idempotent-key', 'drift-page-' || i, 100, 'eur', 'cus_p', 'pm_card_visa', 'succeeded', 'pi_paged' || i, $1
       from generate_series(1, 2001) i returning id`,
      [at],
    );
    try {
      const report = await driftReport(t.pool, e.gateway(), since);
      expect(report.operations).toBe(2001);
      const missing = report.drift.filter((d) => d.kind === 'missing_charge').map((d) => d.operationId);
      expect(missing).toHaveLength(2001);
      expect(new Set(missing)).toEqual(new Set(rows.map((r) => r.id)));
    } finally {
      await t.pool.query(`delete from outboxd.payment_operations where id = any($1::uuid[])`, [rows.map((r) => r.id)]);
    }
  });

  it("reads and counts only the operations of kinds Stripe knows, not an application's effects", async () => {
    const since = new Date(Date.now() - 1000);
    const op = await confirm(t);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const before = await driftReport(t.pool, e.gateway(), since);
    await t.pool.query(
      `insert into outboxd.payment_operations (kind, policy, effect_key, payload, result, status, settled_at)
       values ('bulky_drift_effect', 'at-least-once', 'k', $1::jsonb, $1::jsonb, 'succeeded', now())`,
      [JSON.stringify({ blob: 'x'.repeat(60_000) })],
    );
    const after = await driftReport(t.pool, e.gateway(), since);
    expect(before.operations).toBeGreaterThan(0);
    expect(after.operations).toBe(before.operations);
    expect(after.drift).toEqual(before.drift);
  });

  it('`outboxd reconcile --report` exits 5 when drift exists', async () => {
    await chargeFor('00000000-0000-4000-8000-00000000abcd');
    const bin = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
    const child = spawn(process.execPath, [bin, 'reconcile', '--report', '--since', '1d', '--json'], {
      env: { ...process.env, DATABASE_URL: t.url, STRIPE_API_BASE: e.url, STRIPE_SECRET_KEY: '', LOG_LEVEL: 'silent' },
    });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    const code = await new Promise((r) => child.on('exit', r));
    expect(code).toBe(5);
    expect(JSON.parse(out).drift.map((d: { kind: string }) => d.kind)).toContain('orphan_charge');
  });
});

describe('review resolution', () => {
  it('refuses a pi_ of another operation or amount; accepts the right one and audits it', async () => {
    const op = await lostPastWindow();
    await sweep(); // zero matches → review
    const other = await chargeFor('00000000-0000-4000-8000-000000000001');
    const wrongAmount = await chargeFor(op, { amount: 1 });
    const right = await chargeFor(op);
    const gw = e.gateway();
    await expect(resolve(op, { outcome: 'succeeded', externalId: other!.id }, 'alice', gw)).rejects.toBeInstanceOf(ResolutionRefused);
    await expect(resolve(op, { outcome: 'succeeded', externalId: wrongAmount!.id }, 'alice', gw)).rejects.toThrow(/is 1 eur/);
    await expect(resolve(op, { outcome: 'failed', reason: 'customer says no' }, 'alice', gw)).rejects.toThrow(/have not failed: pi_\w+ \(succeeded\)/);
    expect((await operation(t, op)).status).toBe('unknown');

    const resolved = await resolve(op, { outcome: 'succeeded', externalId: right!.id }, 'alice', gw);
    expect(resolved).toMatchObject({ status: 'succeeded', external_id: right!.id, needs_review: false });
    const { rows } = await t.pool.query(`select actor, action, details from outboxd.admin_audit where operation_id = $1 order by id`, [op]);
    expect(rows).toEqual([
      ...[other, wrongAmount].map((pi) => ({ actor: 'alice', action: 'resolve_refused', details: expect.objectContaining({ outcome: 'succeeded', externalId: pi!.id }) })),
      { actor: 'alice', action: 'resolve_refused', details: expect.objectContaining({ outcome: 'failed', givenReason: 'customer says no' }) },
      { actor: 'alice', action: 'resolve', details: expect.objectContaining({ outcome: 'succeeded', previousStatus: 'unknown' }) },
    ]);
    await expect(resolve(op, { outcome: 'succeeded', externalId: right!.id }, 'alice', gw)).rejects.toThrow(/never overwritten/);
  });

  it('resolving as failed needs a reason and no succeeded charge in Stripe', async () => {
    const op = await lostPastWindow();
    const resolved = await resolve(op, { outcome: 'failed', reason: 'card expired, confirmed in dashboard' }, 'bob');
    expect(resolved).toMatchObject({ status: 'failed' });
    expect(resolved.last_error).toMatch(/resolved by bob/);
  });
});

describe('a resolution never contradicts Stripe (issue 10)', () => {
  /** An unsettled operation whose job is gone and whose last create went out `ago` (SQL interval). */
  async function heldForReview(ago: string, overrides: Parameters<typeof confirm>[1] = {}): Promise<string> {
    const op = await confirm(t, overrides);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    await t.pool.query(
      `update outboxd.payment_operations set status = 'unknown', attempts = 1, review_reason = 'retries exhausted',
         first_attempted_at = now() - $2::interval, last_attempted_at = now() - $2::interval where id = $1`,
      [op, ago],
    );
    return op;
  }

  it('refused while a worker\'s create is in flight; the charge then settles succeeded, never failed', async () => {
    const op = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'latency', ms: 4_000 } });
    const fence = await claim(t, op, 'worker-w');
    const inFlight = executeOperation(t.pool, kindsFor(e.gateway({ timeoutMs: 8_000 })), op, fence);
    await waitUntil(async () => (await operation(t, op)).first_attempted_at !== null, 5_000, 'the create is sent');
    // Search shows nothing yet: the create has not returned. The resolution must not write `failed`.
    await expect(resolve(op, { outcome: 'failed', reason: 'no charge in the dashboard' })).rejects.toThrow(/leased by worker-w until .*try again/);
    const run = await inFlight;
    expect(run.operation.status).toBe('succeeded');
    expect(charges(op)).toHaveLength(1);
    // Audited as tried and refused, never as a resolution.
    const { rows } = await t.pool.query(`select actor, action, details from outboxd.admin_audit where operation_id = $1`, [op]);
    expect(rows).toEqual([{ actor: 'alice', action: 'resolve_refused', details: { outcome: 'failed', givenReason: 'no charge in the dashboard', refused: expect.stringMatching(/leased by worker-w/) } }]);
  });

  it('holds its own lease for the whole evidence check: no claim can start meanwhile', async () => {
    const op = await heldForReview('2 hours');
    e.emulator.addFault({ endpoint: 'search', fault: { kind: 'latency', ms: 3_000 } });
    const resolving = resolve(op, { outcome: 'failed', reason: 'declined by the bank, checked' }, 'alice', e.gateway({ timeoutMs: 10_000 }));
    await waitUntil(async () => (await operation(t, op)).lease_owner === 'resolve:alice', 5_000, 'the resolution holds the lease');
    expect(await claimOperation(t.pool, op, 'worker-x', 10_000, 0)).toBeUndefined();
    expect(await resolving).toMatchObject({ status: 'failed', lease_owner: null });
  });

  it('refused while the operation waits in the outbox or its job is queued', async () => {
    const op = await confirm(t);
    await expect(resolve(op, { outcome: 'failed', reason: 'x' })).rejects.toThrow(/waits in the outbox/);
    await relay(t);
    await expect(resolve(op, { outcome: 'failed', reason: 'x' })).rejects.toThrow(/job \S+ for operation \S+ is created: the workers still drive it/);
    expect(await operation(t, op)).toMatchObject({ status: 'pending', lease_owner: null });
  });

  it('--failed is refused while the known charge is processing', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    const run = await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    expect(run.operation).toMatchObject({ status: 'unknown', external_id: expect.stringMatching(/^pi_/) });
    await t.pool.query(`update outboxd.payment_operations set last_attempted_at = now() - interval '2 hours' where id = $1`, [op]);
    await expect(resolve(op, { outcome: 'failed', reason: 'x' })).rejects.toThrow(/is processing, not failed/);
    expect((await operation(t, op)).status).toBe('unknown');
  });

  it('--failed is refused when search shows a charge for the operation that has not failed', async () => {
    const op = await heldForReview('2 hours');
    await chargeFor(op, { payment_method: 'pm_card_processing' });
    await expect(resolve(op, { outcome: 'failed', reason: 'x' })).rejects.toThrow(/have not failed: pi_\w+ \(processing\)/);
    const declined = await heldForReview('2 hours');
    await chargeFor(declined, { payment_method: 'pm_card_chargeDeclined' });
    expect(await resolve(declined, { outcome: 'failed', reason: 'declined, see dashboard' })).toMatchObject({ status: 'failed' });
  });

  it('--failed reads again each failed charge search shows: its status as indexed may lag a payment since', async () => {
    const declined = await heldForReview('2 hours');
    await chargeFor(declined, { payment_method: 'pm_card_chargeDeclined' }); // 402: its PaymentIntent from the ledger
    const pi = e.emulator.ledger().find((l) => l.paymentIntent.metadata.operation_id === declined)!.paymentIntent;
    const retrieves = () => e.emulator.requests().filter((r) => r.endpoint === 'retrieve' && r.path.includes(pi.id)).length;
    const before = retrieves();
    expect(await resolve(declined, { outcome: 'failed', reason: 'declined, see dashboard' })).toMatchObject({ status: 'failed' });
    expect(retrieves()).toBe(before + 1);
  });

  it('a discrepancy flagged while the resolution checks the evidence stays for a person; the reason it claimed with goes', async () => {
    const op = await heldForReview('2 hours');
    const pi = await chargeFor(op);
    const real = e.gateway();
    // A webhook about a second PaymentIntent with the operation's id lands during the evidence check.
    const racing = Object.assign(Object.create(real), {
      retrieveCharge: async (...args: Parameters<typeof real.retrieveCharge>) => {
        await flagDiscrepancy(t.pool, op, 'webhook payment_intent.succeeded: pi_stray is not the operation\'s charge');
        return real.retrieveCharge(...args);
      },
    });
    expect(await resolve(op, { outcome: 'succeeded', externalId: pi!.id }, 'alice', racing)).toMatchObject({
      status: 'succeeded',
      review_reason: "discrepancy with Stripe: webhook payment_intent.succeeded: pi_stray is not the operation's charge | retries exhausted",
    });
    // Without one, the reason it was held for goes with the resolution.
    const plain = await heldForReview('2 hours');
    expect(await resolve(plain, { outcome: 'succeeded', externalId: (await chargeFor(plain))!.id })).toMatchObject({ status: 'succeeded', review_reason: null });
  });

  it('refused when the review reason is no longer the one the person read (a discrepancy added since)', async () => {
    const op = await heldForReview('2 hours');
    const pi = await chargeFor(op);
    await flagDiscrepancy(t.pool, op, 'webhook payment_intent.succeeded: pi_new is not the operation\'s charge');
    const seen = { ...RESOLVE, reviewReasonSeen: 'retries exhausted' };
    await expect(resolveOperation(t.pool, e.gateway(), op, { outcome: 'succeeded', externalId: pi!.id }, 'alice', seen)).rejects.toThrow(
      /the review reason changed since it was read: read it again: discrepancy with Stripe: .*pi_new/,
    );
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', lease_owner: null });
    // The same reason as a browser's form sends it back (a carriage return before each line feed) is the one read.
    const multiline = await heldForReview('2 hours');
    await t.pool.query(`update outboxd.payment_operations set review_reason = E'checked by hand\\nsee the ticket' where id = $1`, [multiline]);
    const asSent = { ...RESOLVE, reviewReasonSeen: 'checked by hand\r\nsee the ticket' };
    const paid = await chargeFor(multiline);
    expect(await resolveOperation(t.pool, e.gateway(), multiline, { outcome: 'succeeded', externalId: paid!.id }, 'alice', asSent)).toMatchObject({ status: 'succeeded' });
  });

  it('--failed waits out the search-freshness horizon after the last attempt, and says when to try again', async () => {
    const op = await heldForReview('10 minutes');
    await expect(resolve(op, { outcome: 'failed', reason: 'x' })).rejects.toThrow(/600 s ago.*try again in 3\d\d\d s/);
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', lease_owner: null });
    await t.pool.query(`update outboxd.payment_operations set last_attempted_at = now() - interval '61 minutes' where id = $1`, [op]);
    expect(await resolve(op, { outcome: 'failed', reason: 'nothing in Stripe after an hour' })).toMatchObject({ status: 'failed' });
  });

  it('--succeeded must name the operation\'s known charge when it has one', async () => {
    const op = await confirm(t, { paymentMethod: 'pm_card_processing' });
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    await executeOperation(t.pool, kindsFor(e.gateway()), op, await claim(t, op));
    const other = await chargeFor(op);
    await expect(resolve(op, { outcome: 'succeeded', externalId: other!.id })).rejects.toThrow(/is known to Stripe as pi_/);
  });
});

describe('the sweep drives what no job drives (issue 10)', () => {
  it('a dead-lettered unknown operation inside the window is searched, read-only; one match settles through retrieve', async () => {
    const op = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    e.emulator.addFault({ match: { operationId: op }, fault: { kind: 'lose_response_after_commit', mode: 'hang' } });
    const lost = await executeOperation(t.pool, kindsFor(e.gateway({ timeoutMs: 300 })), op, await claim(t, op));
    expect(lost.operation).toMatchObject({ status: 'unknown', external_id: null });
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'retries exhausted' where id = $1`, [op]);
    const report = await sweep();
    expect(report.decisions).toContainEqual(expect.objectContaining({ operationId: op, call: 'search', to: 'succeeded' }));
    expect(await operation(t, op)).toMatchObject({ status: 'succeeded', external_id: charges(op)[0]!.paymentIntent.id });
    expect(e.emulator.requests().filter((r) => r.endpoint === 'create')).toHaveLength(1);
    expect(e.emulator.requests().filter((r) => r.endpoint === 'retrieve')).toHaveLength(1);
  });

  it('zero matches inside the window keeps it unsettled and flagged with its reason (never "not charged"), with no create', async () => {
    // pending, not unknown: a replica killed between recording the attempt and its outcome.
    const op = await confirm(t);
    const reason = 'idempotency key misuse (a bug): IdempotencyKeyMisuse 400';
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [op]);
    await t.pool.query(
      `update outboxd.payment_operations set attempts = 1, first_attempted_at = now() - interval '1 hour', review_reason = $2 where id = $1`,
      [op, reason],
    );
    await sweep();
    expect(await operation(t, op)).toMatchObject({ status: 'unknown', review_reason: reason });
    expect(e.emulator.requests().map((r) => r.endpoint)).toEqual(['search']);
  });

  it('an unsettled operation that no job drives is flagged; one with a live job is not', async () => {
    const orphan = await confirm(t);
    const driven = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [orphan]);
    await relay(t); // `driven` gets a job
    await t.pool.query(`update outboxd.payment_operations set updated_at = now() - interval '1 hour' where id = any($1)`, [[orphan, driven]]);
    const report = await sweep();
    expect(report.undriven).toEqual([orphan]);
    expect((await operation(t, orphan)).review_reason).toMatch(/no job drives this operation/);
    expect(await operation(t, driven)).toMatchObject({ needs_review: false, lease_owner: null });
  });

  it('one the sweep itself reads every run (its PaymentIntent not final) is flagged once its job is lost, though each read touches it; one with a job is not', async () => {
    const [lost, driven] = [await confirm(t), await confirm(t)];
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [lost]);
    await relay(t); // `driven` gets a job
    for (const op of [lost, driven]) {
      const pi = await stripe().paymentIntents.create({ amount: 2599, currency: 'eur', customer: 'cus_test_1', payment_method: 'pm_card_visa', metadata: { operation_id: op } });
      await t.pool.query(
        `update outboxd.payment_operations set status = 'unknown', external_id = $2, attempts = 1, first_attempted_at = now() - interval '2 hours', last_attempted_at = now() - interval '2 hours' where id = $1`,
        [op, pi.id],
      );
    }
    const report = await sweep();
    // Both read (requires_confirmation: not final, still unknown), only the lost one flagged.
    for (const op of [lost, driven]) expect(report.decisions).toContainEqual(expect.objectContaining({ operationId: op, call: 'retrieve', to: 'unknown' }));
    expect(report.undriven).toEqual([lost]);
    expect((await operation(t, lost)).review_reason).toMatch(/no job drives this operation/);
    expect(await operation(t, driven)).toMatchObject({ needs_review: false, lease_owner: null });
  });
});
