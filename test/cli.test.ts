// The CLI as an operator runs it: a real process, stdout for results, stderr for errors, exit codes.
import { spawn } from 'node:child_process';
import { mkdtemp, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createTestDatabase, type TestDb } from './support/db.ts';
import { counts } from './support/fixtures.ts';

const BIN = fileURLToPath(new URL('../bin/outboxd.js', import.meta.url));
let t: TestDb;
beforeAll(async () => {
  t = await createTestDatabase();
});
afterAll(() => t.close());

function outboxd(...args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'warn' } });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    child.on('exit', (code) => resolve({ code, stdout, stderr }));
  });
}

describe('outboxd order confirm', () => {
  it('prints the operation id; --json an object; the same order twice gives the same id', async () => {
    const order = ['order', 'confirm', '--order-id', 'cli-1', '--amount', '1999', '--currency', 'EUR', '--customer', 'cus_1', '--payment-method', 'pm_card_visa'];
    const first = await outboxd(...order);
    expect(first.code).toBe(0);
    expect(first.stdout.trim()).toMatch(/^[0-9a-f-]{36}$/);
    const again = await outboxd(...order, '--json');
    expect(JSON.parse(again.stdout)).toEqual({ operationId: first.stdout.trim(), created: false });
    const shown = await outboxd('ops', 'show', first.stdout.trim());
    expect(JSON.parse(shown.stdout)).toMatchObject({ id: first.stdout.trim(), order_id: 'cli-1', amount: 1999, currency: 'eur', status: 'pending' });
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
    const after = await counts(t);
    expect(after.operations - before.operations).toBe(196);
    expect(after.outbox - before.outbox).toBe(196);
    const rerun = JSON.parse((await outboxd('order', 'confirm', '--from-file', file, '--json')).stdout);
    expect(rerun).toMatchObject({ confirmed: 0, alreadyConfirmed: 196, failed: 4 });
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

  it('ops show of a missing operation exits 4; requeue --dry-run reports without enqueuing', async () => {
    expect((await outboxd('ops', 'show', '3f2504e0-4f89-41d3-9a0c-0305e82c3301')).code).toBe(4);
    const before = await counts(t);
    const res = await outboxd('requeue', '--stuck', '--older-than', '0s', '--dry-run', '--json');
    expect(res.code).toBe(0);
    const results = JSON.parse(res.stdout);
    expect(results.length).toBeGreaterThan(0);
    expect(results.every((r: { result: string }) => r.result === 'skipped')).toBe(true); // each waits in the outbox
    expect(await counts(t)).toEqual(before);
  });
});
