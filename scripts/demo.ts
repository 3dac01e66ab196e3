// `npm run demo`: the seed's story told by the running system. Three worker replicas, a few dozen
// orders, an emulator that loses responses, answers 500 and 429, one replica killed mid-flight; then
// every operation's path and its agreement with the emulator's ledger.
import { randomUUID } from 'node:crypto';
import { reconcileNow } from '../src/admin/reconcile.ts';
import { createLogger } from '../src/telemetry/log.ts';
import { shortOperationId } from '../src/engine/operation.ts';
import { confirmOrder } from '../src/exampleApp/confirm.ts';
import { checkAgainstLedger, pathOf } from '../harness/ledger.ts';
import { waitUntil } from '../harness/replica.ts';
import { startWorld } from '../harness/world.ts';

const ORDERS = 36;
const say = (s: string) => process.stdout.write(`${s}\n`);

const world = await startWorld({
  name: 'demo',
  emulator: { processingSettleMs: 3_000 },
  replicaEnv: { WORKER_CONCURRENCY: '4', LEASE_TTL_MS: '4000', STRIPE_TIMEOUT_MS: '2000' },
});
try {
  const { emulator } = world;
  say(`PostgreSQL: ${world.url.replace(/:[^:@/]+@/, ':***@')}`);
  say(`Stripe emulator: ${world.emulatorUrl} (no real money moves)\n`);
  // Faults hit the first requests that come: lost responses after the charge, 500s before and after it, 429s.
  emulator.addFault({ fault: { kind: 'latency', ms: 150 }, count: Infinity });
  emulator.addFault({ fault: { kind: 'lose_response_after_commit', mode: 'truncate' }, count: 4 });
  emulator.addFault({ fault: { kind: 'lose_response_after_commit', mode: 'reset' }, count: 4 });
  emulator.addFault({ fault: { kind: 'error_before_commit', status: 500 }, count: 3 });
  emulator.addFault({ fault: { kind: 'error_after_commit', status: 500 }, count: 2 });
  emulator.addFault({ fault: { kind: 'rate_limit' }, count: 5 });

  const replicas = await Promise.all([1, 2, 3].map(() => world.startReplica()));
  say(`3 worker replicas: pids ${replicas.map((r) => r.proc.pid).join(', ')}`);

  const pms = ['pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_visa', 'pm_card_chargeDeclined', 'pm_card_processing'];
  const ops: string[] = [];
  for (let i = 0; i < ORDERS; i++) {
    const { operationId } = await confirmOrder(world.pool, {
      orderId: `demo-${i + 1}-${randomUUID().slice(0, 8)}`,
      amount: 500 + i * 25,
      currency: 'eur',
      customer: `cus_demo_${i % 5}`,
      paymentMethod: pms[i % pms.length]!,
    });
    ops.push(operationId);
    if (i === 12) {
      const victim = replicas[0]!;
      victim.kill('SIGKILL');
      say(`kill -9 replica ${victim.proc.pid} with calls in flight; its leases expire and the others take over`);
    }
  }
  say(`${ORDERS} orders confirmed (order + operation + outbox job, one transaction each)\n`);

  const counts = async () =>
    Object.fromEntries(
      (await world.pool.query(`select status, count(*)::int as n from outboxd.payment_operations group by status`)).rows.map((r) => [r.status, r.n]),
    ) as Record<string, number>;
  const replayed500 = () => emulator.requests().filter((r) => r.replayed && r.status === 500).map((r) => r.operationId);
  const started = Date.now();
  let last = '';
  await waitUntil(async () => {
    const c = await counts();
    const line = `succeeded ${c.succeeded ?? 0}  failed ${c.failed ?? 0}  unknown ${c.unknown ?? 0}  pending ${c.pending ?? 0}`;
    if (line !== last) {
      const at = `${((Date.now() - started) / 1000).toFixed(1)}s`.padStart(6);
      process.stdout.write(process.stdout.isTTY ? `\r  ${at}  ${line}   ` : `  ${at}  ${line}\n`);
      last = line;
    }
    // Done when only the operations whose 500 is replayed by their key remain open.
    const open = (c.unknown ?? 0) + (c.pending ?? 0);
    const stuckBy500 = new Set(replayed500()).size;
    return open <= 2 && stuckBy500 >= open;
  }, 120_000, 'the operations to settle');
  say(process.stdout.isTTY ? '\n' : '');

  const open = (await world.pool.query(`select id from outboxd.payment_operations where status in ('pending','unknown')`)).rows.map((r) => r.id as string);
  if (open.length > 0) {
    say(`${open.length} operation(s) stay unknown: Stripe replays the stored 500 for their key, as it must, for 24 h.`);
    say('Fast-forward past the key window (emulator clock +24 h, keys expired, first_attempted_at moved back) and run a reconcile sweep:');
    emulator.advanceClock(24 * 3600_000);
    emulator.pruneKeys();
    await world.pool.query(`update outboxd.payment_operations set first_attempted_at = first_attempted_at - interval '24 hours' where id = any($1)`, [open]);
    const report = await reconcileNow(world.pool, world.gateway, { actor: 'demo', owner: 'demo', leaseTtlMs: 10_000, log: createLogger('silent') });
    for (const d of report.decisions) say(`  ${shortOperationId(d.operationId)} ${d.call} → ${d.to} (${d.evidence ?? d.outcome})`);
    say('');
  }

  const { operations, violations, paid } = await checkAgainstLedger(world.pool, emulator);
  say('operation            order              status     att  fence  charges  emulator saw');
  for (const op of operations.filter((o) => ops.includes(o.id))) {
    say(
      `${shortOperationId(op.id)}   ${(op.order_id ?? "-").padEnd(18)} ${op.status.padEnd(10)} ${String(op.attempts).padStart(3)}  ${String(op.fence).padStart(5)}  ${String(paid.get(op.id) ?? 0).padStart(7)}  ${pathOf(emulator, op.id)}`,
    );
  }
  say(`\n${operations.length} operations, ${emulator.ledger().length} PaymentIntents in the ledger, ${violations.length} disagreement(s)`);
  for (const v of violations) say(`  ✗ ${v.kind} ${v.operationId ?? ''} ${v.detail}`);
  if (violations.length === 0) say('  ✓ every succeeded operation has exactly one charge, every failed one none, every create carried payment-op:<id>');
  process.exitCode = violations.length === 0 ? 0 : 1;
} finally {
  await world.close();
}
