// The CLI as an operator runs it: a real process, stdout for results, stderr for errors, exit codes.
import { spawn } from 'node:child_process';
import { mkdtemp, readFile, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitUntil } from '../../harness/replica.ts';
import { recordAudit } from '../../src/admin/audit.ts';
import { confirmFromFile } from '../../src/exampleApp/bulk.ts';
import { shortOperationId } from '../../src/engine/operation.ts';
import { createTestDatabase, emptyDatabases, type TestDb } from '../support/db.ts';
import { confirm, counts } from '../support/fixtures.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));
let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

const outboxd = (...args: string[]) => outboxdOn(t.url, ...args);
const outboxdOn = (url: string, ...args: string[]) => outboxdWith({ DATABASE_URL: url }, ...args);
function outboxdWith(env: Record<string, string>, ...args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, LOG_LEVEL: 'warn', ...env } });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    child.on('exit', (code) => resolve({ code, stdout, stderr }));
  });
}

describe('on a database not migrated yet', () => {
  const emptyDatabase = emptyDatabases();

  it('every command says so in one line, naming outboxd migrate, instead of a missing relation', async () => {
    const { url } = await emptyDatabase('outboxd_cli_unmigrated');
    for (const args of [['ops', 'list'], ['audit'], ['order', 'confirm', '--order-id', 'o-1', '--amount', '100', '--currency', 'eur', '--customer', 'cus_1', '--payment-method', 'pm_card_visa']]) {
      const res = await outboxdOn(url, ...args);
      expect(res.code, args.join(' ')).toBe(1);
      expect(res.stderr.trim(), args.join(' ')).toMatch(/^outboxd: the database is not migrated in the schema outboxd \(relation "outboxd\.[a-z_]+" does not exist\): run `outboxd migrate`, or check DATABASE_URL and OUTBOXD_SCHEMA$/);
    }
    // What starts pg-boss first finds its schema missing.
    const requeue = await outboxdOn(url, 'requeue', '--stuck', '--dry-run');
    expect(requeue.code).toBe(1);
    expect(requeue.stderr.trim()).toMatch(/^outboxd: the database is not migrated \(pg-boss's schema pgboss is missing\): run `outboxd migrate`/);
  });
});

describe('outboxd order confirm', () => {
  it('prints the operation id; --json an object; the same order twice gives the same id', async () => {
    const order = ['order', 'confirm', '--order-id', 'cli-1', '--amount', '1999', '--currency', 'EUR', '--customer', 'cus_1', '--payment-method', 'pm_card_visa'];
    const first = await outboxd(...order);
    expect(first.code).toBe(0);
    expect(first.stdout.trim()).toMatch(/^[0-9a-f-]{36}$/);
    const again = await outboxd(...order, '--json');
    expect(JSON.parse(again.stdout)).toEqual({ operationId: first.stdout.trim(), created: false });
    const thrice = await outboxd(...order);
    expect(thrice.code).toBe(0);
    expect(thrice.stdout.trim()).toBe(first.stdout.trim());
    expect(thrice.stderr.trim()).toBe(`order cli-1 was already confirmed: operation ${first.stdout.trim()} (status pending)`);
    const shown = await outboxd('ops', 'show', first.stdout.trim());
    expect(JSON.parse(shown.stdout)).toMatchObject({ id: first.stdout.trim(), order_id: 'cli-1', amount: 1999, currency: 'eur', status: 'pending' });
  });

  it('--capture manual and --stripe-account: an authorization on a connected account; capture and cancel it, refused with exit 2 when nothing is held', async () => {
    const hold = await outboxd('order', 'confirm', '--order-id', 'cli-hold', '--amount', '1999', '--currency', 'eur', '--customer', 'cus_1',
      '--payment-method', 'pm_card_visa', '--capture', 'manual', '--stripe-account', 'acct_1CliShop');
    expect(hold.code).toBe(0);
    const charge = hold.stdout.trim();
    expect(JSON.parse((await outboxd('ops', 'show', charge)).stdout)).toMatchObject({ payload: { capture_method: 'manual', stripe_account: 'acct_1CliShop' } });
    const early = await outboxd('capture', charge, '--key', 'ship');
    expect(early.code).toBe(2);
    expect(early.stderr).toMatch(/holds no funds/);
    // Held, as a worker would have recorded it.
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = 'pi_cli', result = '{"amount_capturable": 1999, "capture_before": null}' where id = $1`, [charge]);
    const captured = await outboxd('capture', shortOperationId(charge), '--key', 'ship', '--amount', '1500', '--json');
    expect(captured.code).toBe(0);
    const { operationId, created } = JSON.parse(captured.stdout);
    expect(created).toBe(true);
    const again = await outboxd('capture', charge, '--key', 'ship', '--amount', '1500');
    expect(again.stdout.trim()).toBe(operationId);
    expect(again.stderr.trim()).toBe(`key ship of charge ${charge} was already requested: capture operation ${operationId}`);
    const automaticCharge = await confirm(t);
    const before = await counts(t);
    const cancel = await outboxd('cancel', charge, '--key', 'c', '--reason', 'abandoned');
    expect(cancel.code).toBe(2);
    expect(cancel.stderr).toMatch(/refund it instead/);
    const automatic = await outboxd('capture', automaticCharge, '--key', 'k');
    expect(automatic.code).toBe(2);
    expect(automatic.stderr).toMatch(/captured automatically/);
    expect(await counts(t)).toEqual(before);
  });

  it('bad input: exit 2, the field named on stderr, nothing written', async () => {
    const before = await counts(t);
    const res = await outboxd('order', 'confirm', '--order-id', 'cli-2', '--amount', '-5', '--currency', 'eur', '--customer', 'c', '--payment-method', 'pm');
    expect(res.code).toBe(2);
    expect(res.stderr).toMatch(/amount/);
    const unknownCurrency = await outboxd('order', 'confirm', '--order-id', 'cli-2', '--amount', '5', '--currency', 'zzz', '--customer', 'c', '--payment-method', 'pm');
    expect(unknownCurrency.code).toBe(2);
    expect(unknownCurrency.stderr).toMatch(/currency/);
    expect(await counts(t)).toEqual(before);
  });

  it('--from-file: each line its own confirmation; bad lines reported by number and skipped; exit 3', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'outboxd-bulk-'));
    const file = path.join(dir, 'orders.jsonl');
    const line = (i: number, over: Record<string, unknown> = {}) =>
      JSON.stringify({ orderId: `bulk-${i}`, amount: 100 + i, currency: 'usd', customer: 'cus_b', paymentMethod: 'pm_card_visa', ...over });
    const lines = Array.from({ length: 200 }, (_, i) => line(i));
    lines[9] = '{not json';
    lines[49] = line(49, { amount: 0 });
    lines[99] = line(99, { currency: 'xyz' });
    lines[149] = line(149, { cardNumber: '4242' });
    await writeFile(file, `${lines.join('\n')}\n`);
    const before = await counts(t);
    const res = await outboxd('order', 'confirm', '--from-file', file, '--json');
    expect(res.code).toBe(3);
    const summary = JSON.parse(res.stdout);
    expect(summary).toMatchObject({ lines: 200, confirmed: 196, alreadyConfirmed: 0, failed: 4 });
    expect(summary.failures.map((f: { line: number }) => f.line)).toEqual([10, 50, 100, 150]);
    expect(summary.failures[1]).toMatchObject({ field: 'amount' });
    expect(summary.confirmations).toHaveLength(196);
    expect(summary.confirmations[0]).toEqual({ line: 1, operationId: expect.stringMatching(/^[0-9a-f-]{36}$/), created: true });
    const { rows } = await t.pool.query(`select id from outboxd.payment_operations where order_id = 'bulk-199'`);
    expect(summary.confirmations.at(-1)).toEqual({ line: 200, operationId: rows[0].id, created: true });
    const after = await counts(t);
    expect(after.operations - before.operations).toBe(196);
    expect(after.outbox - before.outbox).toBe(196);
    // Without --json no line's operation is kept: a file of millions of lines would hold as many.
    expect((await confirmFromFile(t.pool, file)).confirmations).toEqual([]);
    const rerun = JSON.parse((await outboxd('order', 'confirm', '--from-file', file, '--json')).stdout);
    expect(rerun).toMatchObject({ confirmed: 0, alreadyConfirmed: 196, failed: 4 });
    // Text: a one-line summary on stdout, the bad lines on stderr.
    const text = await outboxd('order', 'confirm', '--from-file', file);
    expect(text.code).toBe(3);
    expect(text.stdout).toBe('200 lines: 0 confirmed, 196 already confirmed, 4 refused\n');
    expect(text.stderr).toMatch(/^line 10: .*\nline 50: amount: .*\nline 100: currency: .*\nline 150: cardNumber: unknown field\n$/);
  });
});

describe('outboxd ops and requeue', () => {
  it('ops list --json filters by status; an unknown status is a usage error', async () => {
    const res = await outboxd('ops', 'list', '--status', 'pending', '--json');
    expect(res.code).toBe(0);
    const rows = JSON.parse(res.stdout);
    expect(rows.length).toBeGreaterThan(0);
    expect(new Set(rows.map((r: { status: string }) => r.status))).toEqual(new Set(['pending']));
    expect((await outboxd('ops', 'list', '--status', 'bogus')).code).toBe(2);
  });

  it('ops list --newest --limit n gives the last n requested, newest first', async () => {
    for (let i = 0; i < 3; i++) await confirm(t);
    const oldest = JSON.parse((await outboxd('ops', 'list', '--json')).stdout) as { id: string }[];
    const res = await outboxd('ops', 'list', '--newest', '--limit', '2', '--json');
    expect(res.code).toBe(0);
    expect(JSON.parse(res.stdout).map((r: { id: string }) => r.id)).toEqual(oldest.slice(-2).reverse().map((r) => r.id));
    // None, or fewer than none, is a usage error (exit 2), not "no operations" nor PostgreSQL's words.
    for (const args of [['ops', 'list', '--limit', '0'], ['ops', 'list', '--limit', '-1'], ['audit', '--limit', '-3']]) {
      const refused = await outboxd(...args);
      expect(refused).toMatchObject({ code: 2, stderr: expect.stringMatching(/--limit.*must be an integer ≥ 1/) });
    }
  });

  it('ops acknowledge clears a settled operation\'s review reason, audited under --actor; refused for one not held (exit 2)', async () => {
    const op = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), review_reason = 'discrepancy with Stripe: pi_2' where id = $1`, [op]);
    expect((await outboxd('ops', 'acknowledge', op)).stderr).toMatch(/required option '--note <text>'/);
    // The reason as the person read it: one that changed since (a second discrepancy added) is refused.
    const stale = await outboxd('ops', 'acknowledge', op, '--note', 'refunded pi_1', '--review-reason', 'discrepancy with Stripe: pi_1');
    expect(stale).toMatchObject({ code: 2, stderr: expect.stringContaining('changed since it was read: read it again: discrepancy with Stripe: pi_2') });
    const res = await outboxd('ops', 'acknowledge', shortOperationId(op), '--note', 'refunded pi_2', '--review-reason', 'discrepancy with Stripe: pi_2', '--actor', 'bob', '--json');
    expect(res.code).toBe(0);
    expect(JSON.parse(res.stdout)).toMatchObject({ id: op, status: 'succeeded', needs_review: false });
    const { rows } = await t.pool.query(`select actor, details->>'note' as note from outboxd.admin_audit where operation_id = $1 and action = 'acknowledge'`, [op]);
    expect(rows).toEqual([{ actor: 'bob', note: 'refunded pi_2' }]);
    const again = await outboxd('ops', 'acknowledge', op, '--note', 'twice');
    expect(again.code).toBe(2);
    expect(again.stderr).toMatch(/not held for review: nothing to acknowledge/);
  });

  it('ops show of a missing operation exits 4; requeue --dry-run reports without enqueuing', async () => {
    expect((await outboxd('ops', 'show', '3f2504e0-4f89-41d3-9a0c-0305e82c3301')).code).toBe(4);
    const stuck = await confirm(t);
    await t.pool.query(`delete from outboxd.charge_outbox where operation_id = $1`, [stuck]);
    const before = await counts(t);
    const res = await outboxd('requeue', '--stuck', '--older-than', '0s', '--dry-run', '--json');
    expect(res.code).toBe(0);
    const results = JSON.parse(res.stdout);
    expect(results.find((r: { operationId: string }) => r.operationId === stuck)).toEqual({ operationId: stuck, result: 'would_requeue' });
    // The others wait in the outbox: driven, not listed.
    expect(results).toHaveLength(1);
    expect(await counts(t)).toEqual(before);
  });
});

describe('usage errors: said on stderr, exit 2, in flags', () => {
  const OP = '3f2504e0-4f89-41d3-9a0c-0305e82c3301';
  it.each([
    [['ops', 'resolve', OP], /give exactly one of --succeeded or --failed/],
    [['ops', 'resolve', OP, '--succeeded', '--failed'], /give exactly one of --succeeded or --failed/],
    [['ops', 'resolve', OP, '--succeeded'], /--succeeded needs --external-id/],
    [['ops', 'resolve', OP, '--failed'], /--failed needs --reason/],
    [['ops', 'resolve', OP, '--failed', '--external-id', 'pi_1', '--reason', 'r'], /'--external-id <id>' cannot be used with option '--failed'/],
    [['requeue'], /give an operation id, or --stuck/],
    [['requeue', OP, '--stuck'], /give an operation id or --stuck, not both/],
    [['order', 'confirm', '--order-id', 'u-1', '--amount', '5'], /missing --currency, --customer, --payment-method/],
    [['order', 'confirm', '--from-file', 'x.jsonl', '--order-id', 'u-1'], /'--from-file <orders\.jsonl>' cannot be used with option '--order-id <id>'/],
  ])('%j', async (args, message) => {
    const res = await outboxd(...args);
    expect(res.code).toBe(2);
    expect(res.stderr).toMatch(message);
    expect(res.stdout).toBe('');
  });

  it('an operation id is checked before anything opens; one not found, before Stripe is', async () => {
    const nowhere = { DATABASE_URL: 'postgres://outboxd@127.0.0.1:1/none', STRIPE_API_BASE: 'http://127.0.0.1:1' };
    for (const args of [['ops', 'show', 'bogus'], ['ops', 'resolve', '12345', '--failed', '--reason', 'r'], ['requeue', 'x'], ['audit', 'zz'], ['refund', 'no', '--amount', '1', '--key', 'k']]) {
      const res = await outboxdWith(nowhere, ...args);
      expect(res.code).toBe(2);
      expect(res.stderr).toMatch(args[0] === 'refund' ? /^outboxd: CHARGE_OP_ID: not an operation id/ : /^outboxd: OP_ID: not an operation id/);
      expect(res.stdout).toBe('');
    }
    const missing = await outboxdWith({ DATABASE_URL: t.url, STRIPE_API_BASE: 'http://127.0.0.1:1' }, 'ops', 'resolve', OP, '--failed', '--reason', 'r');
    expect(missing.code).toBe(4);
    expect(missing.stdout + missing.stderr).not.toMatch(/emulator/);
  });

  it('invalid values name the flag, not the field', async () => {
    const res = await outboxd('order', 'confirm', '--order-id', ' ', '--amount', '5', '--currency', 'eur', '--customer', 'c', '--payment-method', 'pm_card_visa');
    expect(res.code).toBe(2);
    expect(res.stderr).toBe('outboxd: --order-id: order id must not begin or end with whitespace\n');
    const pm = await outboxd('order', 'confirm', '--order-id', 'u-2', '--amount', '5', '--currency', 'eur', '--customer', 'c', '--payment-method', 'x'.repeat(300));
    expect(pm.stderr).toMatch(/^outboxd: --payment-method: payment method must be at most 255 characters/);
  });

  it('--version prints the package version', async () => {
    const pkg = JSON.parse(await readFile(new URL('../../package.json', import.meta.url), 'utf8'));
    const res = await outboxd('--version');
    expect(res).toEqual({ code: 0, stdout: `${pkg.version}\n`, stderr: '' });
  });
});

describe('order confirm --from-file while the database fails', () => {
  const CLI_BACKENDS = `select pid from pg_stat_activity where datname = current_database() and application_name = 'outboxd-cli'`;
  const waiting = async () => (await t.pool.query(`${CLI_BACKENDS} and wait_event_type = 'Lock'`)).rowCount ?? 0;
  const terminate = async () => (await t.pool.query(`select pg_terminate_backend(pid) from (${CLI_BACKENDS}) cli`)).rowCount ?? 0;

  async function ordersFile(prefix: string, n: number): Promise<string> {
    const file = path.join(await mkdtemp(path.join(tmpdir(), 'outboxd-bulk-')), 'orders.jsonl');
    const lines = Array.from({ length: n }, (_, i) =>
      JSON.stringify({ orderId: `${prefix}-${i + 1}`, amount: 500, currency: 'eur', customer: 'cus_t', paymentMethod: 'pm_card_visa' }),
    );
    await writeFile(file, `${lines.join('\n')}\n`);
    return file;
  }

  /** Holds a lock every confirmation waits for, so that the CLI's connections can be cut while in use. */
  async function lockOrders(): Promise<() => Promise<void>> {
    const client = await t.pool.connect();
    await client.query('begin');
    await client.query('lock table outboxd.orders in exclusive mode');
    return async () => {
      await client.query('rollback');
      client.release();
    };
  }

  it('connections cut mid-run: the lines are retried, none is reported as bad', async () => {
    const file = await ordersFile('cut', 20);
    const unlock = await lockOrders();
    let exited = false;
    const run = outboxd('order', 'confirm', '--from-file', file, '--json').finally(() => (exited = true));
    try {
      await waitUntil(async () => (await waiting()) === 16, 20_000, '16 confirmations in flight');
      for (let cut = 0; cut < 2; cut++) {
        await terminate();
        await waitUntil(async () => exited || (await waiting()) > 0, 20_000, 'a retry (or the end)');
      }
    } finally {
      await unlock();
    }
    const res = await run;
    expect(res.code).toBe(0);
    const summary = JSON.parse(res.stdout);
    expect(summary).toMatchObject({ lines: 20, failed: 0, failures: [], unconfirmed: [] });
    expect(summary.confirmed + summary.alreadyConfirmed).toBe(20);
    const { rows } = await t.pool.query(`select count(*)::int as n from outboxd.payment_operations where order_id like 'cut-%'`);
    expect(rows[0].n).toBe(20);
  });

  it('the database stays unusable: exit 1 naming the lines not confirmed, the rest not read', async () => {
    const file = await ordersFile('gone', 20);
    const before = await counts(t);
    const unlock = await lockOrders();
    let exited = false;
    const run = outboxd('order', 'confirm', '--from-file', file, '--json').finally(() => (exited = true));
    try {
      await waitUntil(async () => (await waiting()) === 16, 20_000, '16 confirmations in flight');
      // Every attempt waits for the lock and has its connection cut, until the CLI gives up.
      await waitUntil(async () => exited || ((await terminate()) && false), 30_000, 'the CLI to give up');
    } finally {
      await unlock();
    }
    const res = await run;
    expect(res.code).toBe(1);
    const summary = JSON.parse(res.stdout);
    expect(summary).toMatchObject({ lines: 16, confirmed: 0, failed: 0, failures: [], unreadFromLine: 17 });
    expect(summary.unconfirmed.map((u: { line: number }) => u.line)).toEqual(Array.from({ length: 16 }, (_, i) => i + 1));
    expect(res.stderr).toMatch(/stopped on a database error \(.*\): lines 1-16 not confirmed, nor lines 17 and after \(not read\)/);
    expect(await counts(t)).toEqual(before);
  });
});

describe('ops show short ids, ops list, audit', () => {
  const A = 'abcdef01-1111-4000-8000-000000000001';
  const B = 'abcdef01-2222-4000-8000-000000000002';
  beforeAll(async () => {
    for (const [id, orderId] of [[A, 'short-a'], [B, 'short-b']] as const) {
      await t.pool.query(`insert into outboxd.orders (id, amount, currency, customer_id, payment_method) values ($1, 100, 'eur', 'cus', 'pm_card_visa')`, [orderId]);
      await t.pool.query(
        `insert into outboxd.payment_operations (id, order_id, amount, currency, customer_id, payment_method) values ($1, $2, 100, 'eur', 'cus', 'pm_card_visa')`,
        [id, orderId],
      );
    }
  });

  it('ops show takes a unique prefix of 8+ hex digits; ambiguous: exit 2 listing both; none: exit 4', async () => {
    for (const short of ['abcdef011111', 'ABCDEF01-1111', A]) {
      const res = await outboxd('ops', 'show', short);
      expect(res.code).toBe(0);
      expect(JSON.parse(res.stdout)).toMatchObject({ id: A, order_id: 'short-a' });
    }
    const ambiguous = await outboxd('ops', 'show', 'abcdef01');
    expect(ambiguous.code).toBe(2);
    expect(ambiguous.stderr).toBe(`outboxd: OP_ID: abcdef01 is ambiguous, it begins ${A}, ${B}\n`);
    const none = await outboxd('ops', 'show', '01234567');
    expect(none.code).toBe(4);
    expect(none.stderr).toMatch(/no payment operation 01234567/);
    const tooShort = await outboxd('ops', 'show', 'abcdef0');
    expect(tooShort.code).toBe(2);
    expect(tooShort.stderr).toMatch(/^outboxd: OP_ID: not an operation id/);
  });

  it('requeue and ops resolve take the same short ids', async () => {
    const dry = await outboxd('requeue', 'abcdef011111', '--dry-run', '--json');
    expect(dry.code, dry.stderr).toBe(0);
    expect(JSON.parse(dry.stdout)).toMatchObject([{ operationId: A }]);
    const ambiguous = await outboxd('requeue', 'abcdef01', '--dry-run');
    expect(ambiguous.code).toBe(2);
    expect(ambiguous.stderr).toMatch(/abcdef01 is ambiguous/);
  });

  it('ops list shows a review reason only for operations in review', async () => {
    await t.pool.query(`update outboxd.payment_operations set last_error = 'timeout talking to stripe' where id = $1`, [A]);
    await t.pool.query(`update outboxd.payment_operations set review_reason = 'key window passed, no charge found' where id = $1`, [B]);
    const res = await outboxd('ops', 'list');
    expect(res.code).toBe(0);
    const lines = res.stdout.split('\n');
    expect(lines[0]).toMatch(/^id +kind +order +status +amount +attempts +external +review$/);
    expect(lines.find((l) => l.startsWith(A))).toMatch(/pending +100 eur +0 +- +$/);
    expect(lines.find((l) => l.startsWith(B))).toMatch(/ - +key window passed, no charge found$/);
  });

  it('audit lists the trail, newest last, of one operation (short id) or of all (--limit)', async () => {
    const op = await confirm(t);
    await recordAudit(t.pool, { actor: 'alice', action: 'requeue', operationId: op, details: { jobId: 'j1' } });
    await recordAudit(t.pool, { actor: 'bob', action: 'resolve', operationId: A, details: { outcome: 'failed' } });
    await recordAudit(t.pool, { actor: 'carol', action: 'reconcile', operationId: op, details: { settled: 1 } });
    const one = await outboxd('audit', shortOperationId(op), '--json');
    expect(one.code).toBe(0);
    expect(JSON.parse(one.stdout)).toMatchObject([
      { actor: 'alice', action: 'requeue', operation_id: op, details: { jobId: 'j1' } },
      { actor: 'carol', action: 'reconcile', operation_id: op, details: { settled: 1 } },
    ]);
    const newest = await outboxd('audit', '--limit', '2', '--json');
    expect(JSON.parse(newest.stdout).map((e: { actor: string }) => e.actor)).toEqual(['bob', 'carol']);
    const text = await outboxd('audit', A);
    expect(text.stdout).toMatch(new RegExp(`^at +actor +action +operation +details\n\\S+Z +bob +resolve +${A} +\\{"outcome":"failed"\\}\n$`));
    expect((await outboxd('audit', '01234567')).code).toBe(4);
    expect((await outboxd('audit', '3f2504e0-4f89-41d3-9a0c-0305e82c3301')).code).toBe(4);
  });
});
