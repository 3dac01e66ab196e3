// No request can stop a replica (issue 10): a real `outboxd worker` process gets a few thousand
// malformed and random requests over raw TCP, at every route it serves (admin API on the same port, as
// by default), and answers each (or closes the socket on garbage, as Node does) and stays alive.
// Seeded: FUZZ_SEED=<n> replays a run; a failure prints the seed and the request.
// The library's requests get text PostgreSQL cannot store (U+0000, half a surrogate pair) in every field,
// at any depth: each is refused with a ValidationError naming the field, and the caller's transaction
// goes on (issue 22).
import { randomUUID } from 'node:crypto';
import { request } from 'node:http';
import pg from 'pg';
import Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startReplica, type Replica } from '../../harness/replica.ts';
import { Outboxd, ValidationError } from '../../src/index.ts';
import { createTestDatabase, inAppTransaction, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { confirm } from '../support/fixtures.ts';
import { seededRandom } from '../../harness/random.ts';
import { rawRequest, type RawAnswer } from '../support/rawHttp.ts';

const SEED = Number(process.env.FUZZ_SEED ?? 20_261_202);
const REQUESTS = 3_000;
const PARALLEL = 12;
const TOKEN = 'fuzz-admin-token-0123456789';
const WEBHOOK_SECRET = 'whsec_fuzz';

let t: TestDb;
let e: RunningEmulator;
let replica: Replica;
let ops: string[];

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
  ops = await Promise.all(Array.from({ length: 3 }, () => confirm(t, { paymentMethod: 'pm_card_processing' })));
  replica = await startReplica({
    DATABASE_URL: t.url,
    STRIPE_API_BASE: e.url,
    ADMIN_TOKEN: TOKEN,
    STRIPE_WEBHOOK_SECRET: WEBHOOK_SECRET,
    HTTP_HOST: '127.0.0.1',
  });
});
afterAll(async () => {
  replica?.kill('SIGKILL');
  await replica?.exited;
  await Promise.all([t.close(), e.close()]);
});

interface Case {
  kind: string;
  payload: Buffer;
  /** A whole request that the server must answer; otherwise it may also just close. */
  complete: boolean;
  /** Sent with the admin token: a 500 there may carry its cause (the admin API's choice). */
  authorized: boolean;
}

function generator(seed: number) {
  const rnd = seededRandom(seed);
  const int = (n: number) => Math.floor(rnd() * n);
  const pick = <T>(xs: readonly T[]): T => xs[int(xs.length)]!;
  const chance = (p: number) => rnd() < p;
  const bytes = (n: number) => Buffer.from(Array.from({ length: n }, () => int(256)));
  const text = (n: number) => Array.from({ length: n }, () => String.fromCharCode(32 + int(95))).join('');
  const uuid = () => pick([...ops, '3f2504e0-4f89-41d3-9a0c-0305e82c3301', 'not-a-uuid', '%', '%zz', '%E0%A4%A', '..', '%2e%2e', '%00', text(8), 'x'.repeat(300)]);

  const ADMIN_PATHS = () => [
    '/admin/operations',
    `/admin/operations?status=${pick(['pending', 'bogus', '%', ''])}&needs_review=${pick(['true', 'x'])}&limit=${pick(['1', '0', '-5', 'abc', '99999999999'])}`,
    `/admin/operations/${uuid()}`,
    `/admin/operations/${uuid()}/resolve`,
    `/admin/operations/${uuid()}/requeue`,
    '/admin/requeue-stuck',
    '/admin/reconcile',
  ];
  const paths = () => [
    '/healthz', '/readyz', '/metrics', '/webhooks/stripe', ...ADMIN_PATHS(),
    '/', '//', '///healthz', '/%', '/%%', '/admin/operations/%', '/healthz?%', '/a/../healthz', '/\\healthz', '/%00',
    '*', 'http://elsewhere/healthz', 'healthz', '?x', `/${text(int(40))}`, `/${'a/'.repeat(500)}`,
  ];
  const methods = ['GET', 'POST', 'PUT', 'DELETE', 'HEAD', 'OPTIONS', 'PATCH', 'PROPFIND', 'PURGE', 'TRACE', 'QUERY', 'FOO', 'get', 'G_ET', 'M-SEARCH'];
  const jsonBodies = () => [
    '', '{}', '{', 'null', '[]', '"x"', '1e999', '{"__proto__":{"x":1}}', '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]',
    JSON.stringify({ outcome: pick(['succeeded', 'failed', 'maybe', 1]), externalId: pick(['pi_123', 'ch_1', '', null]), reason: pick(['', ' ', 'fuzz', 'r'.repeat(2000)]) }),
    JSON.stringify({ dryRun: pick([true, false, 'yes', null]) }),
    JSON.stringify({ olderThanSeconds: pick([0, -1, 1e12, 1.5, '600']), dryRun: pick([true, 1]) }),
    JSON.stringify({ id: 'evt_fuzz', object: 'event', type: 'payment_intent.succeeded', data: { object: { id: 'pi_x', metadata: { operation_id: uuid() } } } }),
    text(int(200)),
    // Text PostgreSQL cannot store, as JSON escapes: refused as input, never a database error.
    JSON.stringify({ outcome: 'failed', reason: pick(['a\u0000b', '\u0000']) }),
    pick(['{"outcome":"failed","reason":"x\\ud800"}', '{"outcome":"succeeded","externalId":"pi_\\udfff"}', '{"outcome":"succeeded","externalId":"pi_\\u0000"}']),
    'x'.repeat(70_000), // over the admin API's 64 KiB
  ];

  const header = (name: string, value: string) => `${name}: ${value}\r\n`;
  const request = (m: string, target: string, headers: string, body: Buffer | string = '') =>
    Buffer.concat([Buffer.from(`${m} ${target} HTTP/1.1\r\n${headers}\r\n`, 'latin1'), Buffer.isBuffer(body) ? body : Buffer.from(body)]);

  function wellFramed(authorized: boolean): Case {
    const target = authorized ? pick(ADMIN_PATHS()) : pick(paths());
    const m = authorized ? pick(['GET', 'POST']) : pick(methods);
    const body = chance(0.1) ? bytes(int(300)) : Buffer.from(pick(jsonBodies()));
    let headers = header('Host', 'outboxd') + header('Connection', 'close');
    if (authorized) headers += header('Authorization', `Bearer ${TOKEN}`);
    else if (chance(0.3)) headers += header('Authorization', pick(['Bearer', 'Bearer wrong-token-wrong-token', 'Basic YTpi', `Bearer ${'t'.repeat(5000)}`, 'Bearer %']));
    if (chance(0.3)) headers += header('Stripe-Signature', pick(['', 't=1,v1=abc', `t=${Math.floor(Date.now() / 1000)},v1=${'0'.repeat(64)}`, text(50)]));
    else if (chance(0.1)) {
      const payload = body.toString('latin1');
      headers += header('Stripe-Signature', Stripe.webhooks.generateTestHeaderString({ payload, secret: 'whsec_someone_else' }));
    }
    if (chance(0.3)) headers += header('Content-Type', pick(['application/json', 'text/plain', '', 'application/json; charset=utf-16']));
    if (chance(0.5)) headers += header('Content-Length', String(body.length));
    else headers += header('Transfer-Encoding', 'chunked');
    const framed = headers.includes('Content-Length') ? body : Buffer.concat([Buffer.from(`${body.length.toString(16)}\r\n`), body, Buffer.from('\r\n0\r\n\r\n')]);
    return { kind: authorized ? 'admin' : 'request', payload: request(m, target, headers, framed), complete: true, authorized };
  }

  const broken: Record<string, () => Buffer> = {
    truncatedBody: () => request('POST', pick(paths()), header('Host', 'x') + header('Content-Length', String(100 + int(1000))), text(int(50))),
    truncatedChunks: () => request('POST', pick(paths()), header('Host', 'x') + header('Transfer-Encoding', 'chunked'), `${pick(['ff', 'zz', '-1', 'ffffffffffffffff', '5;ext=' + 'e'.repeat(20_000)])}\r\nabc`),
    truncatedHeaders: () => Buffer.from(`GET /healthz HTTP/1.1\r\nHost: x\r\n${text(int(100))}`),
    badRequestLine: () => Buffer.from(pick([
      'GET /healthz\r\n\r\n', 'GET  /healthz  HTTP/1.1\r\n\r\n', 'GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n', '/healthz GET HTTP/1.1\r\n\r\n',
      'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n', 'GET /he\x00althz HTTP/1.1\r\n\r\n', 'GET /healthz HTTP/1.1\n\n', '\r\n\r\n\r\n',
      `GET /${'x'.repeat(70_000)} HTTP/1.1\r\nHost: x\r\n\r\n`, `${'A'.repeat(100)} / HTTP/1.1\r\n\r\n`, 'CONNECT outboxd:443 HTTP/1.1\r\nHost: x\r\n\r\n',
      'GET /healthz HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n',
    ]) + (chance(0.5) ? text(int(30)) : ''), 'latin1'),
    badHeaders: () => request(pick(methods), pick(paths()), pick([
      header('Host', 'x') + header('Content-Length', '5') + header('Content-Length', '6'),
      header('Host', 'x') + header('Content-Length', '-1'),
      header('Host', 'x') + header('Content-Length', 'abc'),
      header('Host', 'x') + header('Content-Length', '5') + header('Transfer-Encoding', 'chunked'),
      header('Host', 'x') + header('Bad Name', 'v'),
      header('Host', 'x') + 'NoColon\r\n',
      header('Host', 'x') + header('X-Folded', 'a') + ' folded\r\n',
      header('Host', 'x') + header('X-Ctl', 'a\x01b'),
      header('X-Big', 'b'.repeat(20_000 + int(20_000))),
      Array.from({ length: 3_000 }, (_, i) => header(`X-${i}`, 'v')).join(''),
    ])),
    randomBytes: () => bytes(1 + int(2_000)),
  };
  const brokenKinds = Object.keys(broken);

  return (): Case => {
    const r = rnd();
    if (r < 0.55) return wellFramed(false);
    if (r < 0.7) return wellFramed(true);
    const kind = pick(brokenKinds);
    return { kind, payload: broken[kind]!(), complete: false, authorized: false };
  };
}

describe('fuzzing a real worker process', () => {
  it(`answers ${REQUESTS} malformed and random requests and stays alive (seed ${SEED})`, async () => {
    const next = generator(SEED);
    const cases = Array.from({ length: REQUESTS }, next);
    const results: { c: Case; a: RawAnswer }[] = [];
    let i = 0;
    await Promise.all(
      Array.from({ length: PARALLEL }, async () => {
        while (i < cases.length) {
          const c = cases[i++]!;
          results.push({ c, a: await rawRequest(replica.port, c.payload, { halfClose: !c.complete, timeoutMs: 10_000 }) });
        }
      }),
    );
    const show = ({ c, a }: { c: Case; a: RawAnswer }) =>
      `seed ${SEED}, ${c.kind}: ${JSON.stringify(c.payload.toString('latin1').slice(0, 300))} → ${JSON.stringify(a.text.slice(0, 300))}`;
    // The first few of each kind of failure: enough to replay by the seed, short enough to read.
    const failures = (keep: (r: { c: Case; a: RawAnswer }) => boolean) => results.filter(keep).slice(0, 10).map(show);

    // Every connection ended: nothing hangs.
    expect(failures((r) => !r.a.closed)).toEqual([]);
    // Every whole request got an answer.
    expect(failures((r) => r.c.complete && r.a.status === null)).toEqual([]);
    // No 5xx for anyone without the token; the token holder's 500s (if any) are the admin API's to explain.
    expect(failures((r) => (r.a.status ?? 0) >= 500 && !r.c.authorized)).toEqual([]);
    // Unstorable text is the caller's mistake, for the token holder too.
    expect(failures((r) => (r.a.status ?? 0) >= 500 && /\\u(0000|d[89a-f])/i.test(r.c.payload.toString('latin1')))).toEqual([]);
    const statuses = new Set(results.map((r) => r.a.status));
    for (const s of [200, 400, 401, 404, 413, 422, 431]) expect(statuses, `some request got ${s}`).toContain(s);

    // Alive and well: not exited, and still answering.
    expect(replica.proc.exitCode).toBeNull();
    expect(replica.proc.signalCode).toBeNull();
    expect((await replica.get('/healthz')).status).toBe(200);
    expect((await replica.get('/readyz')).status).toBe(200);
    // The fuzz's wrong tokens made its client wait (the token throttle); from another address the token
    // holder is served.
    const fromElsewhere = await new Promise<number>((resolve, reject) =>
      request({ host: '127.0.0.1', port: replica.port, path: '/admin/operations', localAddress: '127.0.0.9', headers: { Authorization: `Bearer ${TOKEN}` } }, (res) => {
        res.resume();
        resolve(res.statusCode!);
      }).on('error', reject).end(),
    );
    expect(fromElsewhere).toBe(200);
    // No internal failure was logged while serving.
    expect(replica.logs.filter((l) => l.msg === 'HTTP handler failed' || l.msg === 'HTTP request failed while answering' || l.msg === 'HTTP listener error')).toEqual([]);
  });
});

describe('fuzzing the library with text PostgreSQL cannot store', () => {
  const CASES = 300;
  const BAD = ['\u0000', '\ud800', '\udbff', '\udc00', '\udfff', 'x\ud83d', '\ude00y'];
  let outboxd: Outboxd;
  let appPool: pg.Pool;
  let charged: string;
  beforeAll(async () => {
    appPool = new pg.Pool({ connectionString: t.url, max: 2 });
    outboxd = new Outboxd({ connectionString: t.url });
    outboxd.defineEffect('fuzz_note', { policy: 'at-least-once', execute: async () => null });
    charged = await confirm(t);
    await t.pool.query(`update outboxd.payment_operations set status = 'succeeded', settled_at = now(), external_id = 'pi_fuzz' where id = $1`, [charged]);
  });
  afterAll(async () => {
    await outboxd?.stop();
    await appPool?.end();
  });

  interface LibCase {
    call: (tx: pg.PoolClient) => Promise<unknown>;
    field: string;
    shown: unknown;
  }

  function libraryCases(seed: number): LibCase[] {
    const rnd = seededRandom(seed);
    const int = (n: number) => Math.floor(rnd() * n);
    const pick = <T>(xs: readonly T[]): T => xs[int(xs.length)]!;
    const word = () => Array.from({ length: 1 + int(8) }, () => String.fromCharCode(97 + int(26))).join('');
    /** `s` with one unstorable piece at a random place. */
    const spoil = (s: string) => {
      const at = int(s.length + 1);
      return s.slice(0, at) + pick(BAD) + s.slice(at);
    };
    /** A JSON value, nested, with one unstorable key or string somewhere; returns it and where it is. */
    const spoiledJson = (path: string, depth: number): { value: unknown; at: string } => {
      const r = rnd();
      if (depth === 0 || r < 0.25) return { value: spoil(word()), at: path };
      if (r < 0.5) {
        const items: unknown[] = Array.from({ length: int(3) }, word);
        const i = int(items.length + 1);
        const inner = spoiledJson(`${path}[${i}]`, depth - 1);
        items.splice(i, 0, inner.value);
        return { value: items, at: inner.at };
      }
      const obj: Record<string, unknown> = Object.fromEntries(Array.from({ length: int(3) }, () => [word(), pick([word(), 1, true, null])]));
      if (r < 0.65) {
        obj[spoil(word())] = word();
        return { value: obj, at: `${path} (a key)` };
      }
      const key = `k${word()}`;
      const inner = spoiledJson(`${path}.${key}`, depth - 1);
      obj[key] = inner.value;
      return { value: obj, at: inner.at };
    };
    const charge = () => ({ orderId: randomUUID() as string, amount: 1 + int(10_000), currency: 'eur', customer: `cus_${word()}`, paymentMethod: 'pm_card_visa' });
    const kinds: (() => LibCase)[] = [
      () => {
        const field = pick(['orderId', 'customer', 'paymentMethod'] as const);
        const req = charge();
        req[field] = spoil(req[field]);
        return { call: (tx) => outboxd.requestCharge(tx, req), field, shown: req };
      },
      () => {
        const key = word();
        const metadata = { [pick([key, spoil(key)])]: word(), [word() + 'z']: word() };
        const spoiledKey = !(key in metadata);
        if (!spoiledKey) metadata[key] = spoil(metadata[key]!);
        return { call: (tx) => outboxd.requestCharge(tx, { ...charge(), metadata }), field: spoiledKey ? 'metadata' : `metadata.${key}`, shown: metadata };
      },
      () => {
        const req = { chargeOperationId: charged, amount: 1, key: spoil(word()) };
        return { call: (tx) => outboxd.requestRefund(tx, req), field: 'key', shown: req };
      },
      () => {
        const req = { key: spoil(word()), payload: { n: int(100) } };
        return { call: (tx) => outboxd.requestEffect(tx, 'fuzz_note', req), field: 'key', shown: req };
      },
      () => {
        const { value, at } = spoiledJson('payload', 4);
        const req = { key: word(), payload: value };
        return { call: (tx) => outboxd.requestEffect(tx, 'fuzz_note', req), field: at, shown: req };
      },
    ];
    return Array.from({ length: CASES }, () => pick(kinds)());
  }

  const operations = async () => Number((await t.pool.query(`select count(*) from outboxd.payment_operations`)).rows[0].count);

  it(`refuses ${CASES} requests naming the field, writes nothing, and the caller's transaction commits what follows (seed ${SEED})`, async () => {
    const before = await operations();
    const wrong: string[] = [];
    for (const c of libraryCases(SEED)) {
      const show = `seed ${SEED}: ${JSON.stringify(c.shown)}`;
      await inAppTransaction(appPool, async (tx) => {
        const err = await c.call(tx).then(() => undefined, (e: unknown) => e);
        if (!(err instanceof ValidationError) || err.field !== c.field) wrong.push(`${show} → ${String(err)} (wanted a ValidationError of ${c.field})`);
        // The same transaction goes on: another request in it, committed.
        await outboxd.requestEffect(tx, 'fuzz_note', { key: randomUUID(), payload: { after: 'a refusal' } });
      });
      if (wrong.length >= 10) break;
    }
    expect(wrong).toEqual([]);
    // Only the requests that followed each refusal were written.
    expect(await operations()).toBe(before + CASES);
  });
});
