// The HTTP listener facing Stripe (and so anyone): malformed requests get a 4xx or a closed socket,
// never an exception that ends the process, and a 500 outside the admin API tells nothing of its cause.
import { Writable } from 'node:stream';
import { pino } from 'pino';
import Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { loadConfig } from '../../src/runtime/config.ts';
import { createPool } from '../../src/db/pool.ts';
import { freePort } from '../../src/db/embedded.ts';
import { adminRoutes } from '../../src/http/admin.ts';
import { HttpError, readBody, sendJson, startHttpServer, type HttpServer } from '../../src/http/server.ts';
import { webhookRoutes } from '../../src/http/webhooks.ts';
import { rawRequest } from '../support/rawHttp.ts';
import { createTestDatabase } from '../support/db.ts';
import { startEmulator } from '../support/emulator.ts';

const TOKEN = 'test-admin-token-0123456789';
const SECRET = 'whsec_http_test';
const logged: Record<string, unknown>[] = [];
const log = pino(
  { level: 'debug' },
  new Writable({
    write(chunk, _enc, done) {
      logged.push(JSON.parse(String(chunk)));
      done();
    },
  }),
);
let http: HttpServer;
let base: string;
let unreachable: ReturnType<typeof createPool>;

beforeAll(async () => {
  // A database nobody listens on: every query fails with an error whose text names the host and port.
  unreachable = createPool(`postgres://outboxd:pw@127.0.0.1:${await freePort()}/outboxd`, { schema: 'outboxd' });
  const config = loadConfig({ ADMIN_TOKEN: TOKEN });
  http = await startHttpServer(
    0,
    [
      ['GET', '/ok', ({ res }) => sendJson(res, 200, { ok: true })],
      ['GET', /^\/items\/([^/]+)$/, ({ res, params }) => sendJson(res, 200, { id: params[0] })],
      ['GET', '/boom', () => {
        throw new Error('relation "secret_table" does not exist at 10.0.0.7');
      }],
      ['POST', '/echo', async ({ req, res }) => sendJson(res, 200, { bytes: (await readBody(req, 1024)).length })],
      ['GET', '/write-after-end', ({ res }) => {
        res.end('done');
        res.write('more');
      }],
      ['GET', '/teapot', () => {
        throw new HttpError(418, 'teapot', 'short and stout');
      }],
      ...adminRoutes({ pool: unreachable, boss: undefined as never, gateway: undefined as never, log, config, workerId: 'http-test' }),
      ...webhookRoutes({ pool: unreachable, gateway: undefined as never, log, secrets: [SECRET] }),
    ],
    '127.0.0.1',
    log,
  );
  base = `http://127.0.0.1:${http.port}`;
});
afterAll(async () => {
  await http.close();
  await unreachable.end();
});

const request = (line: string, headers = 'Host: x\r\nConnection: close\r\n', body = '') => rawRequest(http.port, `${line}\r\n${headers}\r\n${body}`);
const json = (text: string) => JSON.parse(text.slice(text.indexOf('\r\n\r\n') + 4));

describe('malformed requests', () => {
  it('a target that is not a plain path, and a bad percent-escape, get a 4xx', async () => {
    expect((await request('GET // HTTP/1.1')).status).toBe(404);
    expect((await request('GET //ok HTTP/1.1')).status).toBe(404);
    expect((await request('GET * HTTP/1.1')).status).toBe(400);
    expect((await request('OPTIONS * HTTP/1.1')).status).toBe(400);
    expect((await request('GET http://elsewhere/ok HTTP/1.1')).status).toBe(400);
    const bad = await request('GET /items/% HTTP/1.1');
    expect(bad.status).toBe(400);
    expect(json(bad.text)).toEqual({ error: 'bad_request', message: 'malformed percent-escape in the path' });
    expect((await request('GET /items/%E0%A4%A HTTP/1.1')).status).toBe(400);
    // Before authentication, on the admin routes as on any other.
    expect((await request('GET /admin/operations/% HTTP/1.1')).status).toBe(400);
    expect((await request('GET /items/a%20b HTTP/1.1')).text).toContain('{"id":"a b"}');
  });

  it('a path the URL parser would rewrite into another route (dot segments, backslashes) is refused, not served as that route', async () => {
    // What a proxy that passes on only /webhooks/stripe… by its prefix lets through.
    for (const target of ['/webhooks/stripe/../../ok', '/webhooks/stripe/%2e%2e/%2E%2E/ok', '/webhooks/stripe\\..\\..\\ok', '/./ok', '/items/..', '/items\\x']) {
      const res = await request(`GET ${target} HTTP/1.1`);
      expect(res.status, target).toBe(400);
      expect(json(res.text), target).toEqual({ error: 'bad_request', message: 'the path must not hold dot segments or backslashes' });
    }
    // Dots inside a segment, and in the query, are a path's own.
    expect((await request('GET /items/a..b HTTP/1.1')).text).toContain('{"id":"a..b"}');
    expect((await request('GET /items/.x HTTP/1.1')).text).toContain('{"id":".x"}');
    expect((await request('GET /ok?next=/../x HTTP/1.1')).status).toBe(200);
  });

  it('unknown methods, unparseable request lines and oversized headers: Node refuses them, the server lives', async () => {
    expect((await request('FOO /ok HTTP/1.1')).status).toBe(400);
    expect((await request('PROPFIND /ok HTTP/1.1')).status).toBe(404);
    expect((await rawRequest(http.port, 'garbage\r\n\r\n', { halfClose: true })).status).toBe(400);
    expect((await rawRequest(http.port, 'GET /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n', { halfClose: true })).status).toBe(400);
    expect((await request('GET /ok HTTP/1.1', `Host: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n`)).status).toBe(431);
    expect(logged.some((l) => l.msg === 'unparseable HTTP request refused' && l.code === 'HPE_HEADER_OVERFLOW')).toBe(true);
    expect((await fetch(`${base}/ok`)).status).toBe(200);
  });

  it('a body over the limit is refused with 413 and the connection closed, announced or not', async () => {
    const announced = await request('POST /echo HTTP/1.1', 'Host: x\r\nContent-Length: 99999999\r\n', 'abc');
    expect(announced.status).toBe(413);
    expect(announced.closed).toBe(true);
    const chunked = await rawRequest(http.port, `POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n${'x'.repeat(0x800)}\r\n`);
    expect(chunked.status).toBe(413);
    expect(chunked.closed).toBe(true);
    // A body cut short: the request is abandoned when the client goes, and nothing is logged as an error.
    const before = logged.length;
    const truncated = await rawRequest(http.port, 'POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc', { halfClose: true });
    expect(truncated.closed).toBe(true);
    expect(logged.slice(before).filter((l) => (l.level as number) >= 50)).toEqual([]);
    expect((await fetch(`${base}/echo`, { method: 'POST', body: 'hello' }).then((r) => r.json()))).toEqual({ bytes: 5 });
  });

  it('a handler writing after the end does not take the process down', async () => {
    const res = await fetch(`${base}/write-after-end`);
    expect(await res.text()).toBe('done');
    await expect.poll(() => logged.some((l) => l.msg === 'HTTP response not delivered')).toBe(true);
    expect((await fetch(`${base}/ok`)).status).toBe(200);
  });
});

describe('the webhook endpoint under a flood of requests anyone can send', () => {
  const post = (port: number, body: string, signature = 't=1,v1=00') =>
    fetch(`http://127.0.0.1:${port}/webhooks/stripe`, { method: 'POST', body, headers: { 'Stripe-Signature': signature } });

  it('holds a bounded number of unsigned bytes (beyond: 503, connection closed); a body still trickling in is dropped at its deadline', async () => {
    // Two trickles of 3 bytes and a 2-byte body fit; an 8-byte one does not.
    const routes = webhookRoutes({ pool: unreachable, gateway: undefined as never, log, secrets: [SECRET], maxUnverifiedBytes: 2 * 3 + 4, bodyDeadlineMs: 1_500 });
    const server = await startHttpServer(0, routes, '127.0.0.1', log);
    try {
      // Two bodies that never finish arriving: 3 bytes held each.
      const trickles = [1, 2].map(() => rawRequest(server.port, 'POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc', { timeoutMs: 10_000 }));
      let refused: Response | undefined;
      await expect.poll(async () => (refused = await post(server.port, '{"a":12}')).status, { timeout: 1_000 }).toBe(503);
      expect(refused!.headers.get('retry-after')).toBe('1');
      expect(refused!.headers.get('connection')).toBe('close');
      expect(await refused!.json()).toMatchObject({ error: 'busy' });
      expect(logged.some((l) => l.msg?.toString().startsWith('stripe webhook refused (503): too many webhook bodies being read'))).toBe(true);
      expect((await post(server.port, '{}')).status).toBe(400); // what still fits is read, its signature refused
      // At the deadline each trickle's connection is dropped unanswered, and what it held is free again.
      for (const t of await Promise.all(trickles)) expect(t).toMatchObject({ status: null, closed: true });
      expect((await post(server.port, '{"a":12}')).status).toBe(400);
    } finally {
      await server.close();
    }
  });

  it('forged requests are counted, and said in one line a minute with how many: a line each let anyone make the replica write (and, its log stalled, hold) more than they sent', async () => {
    const refusals: string[] = [];
    const routes = webhookRoutes({ pool: unreachable, gateway: undefined as never, log, secrets: [SECRET], onRefused: (reason) => refusals.push(reason) });
    const server = await startHttpServer(0, routes, '127.0.0.1', log);
    try {
      const before = logged.length;
      for (let i = 0; i < 200; i++) expect((await post(server.port, '{"id":"evt_forged"}')).status).toBe(400);
      const lines = logged.slice(before).filter((l) => l.msg?.toString().startsWith('stripe webhook refused: bad signature'));
      expect(lines).toHaveLength(1);
      expect(lines[0]).toMatchObject({ refused: 1, err: expect.stringMatching(/signature/i) });
      expect(refusals).toEqual(Array(200).fill('bad_signature'));
    } finally {
      await server.close();
    }
  });

  it('a body sent a byte a chunk holds what its bytes take, not a buffer a chunk: a few such bodies held open leave room for Stripe’s', async () => {
    // The default budget (32 MiB). 8,190 one-byte chunks are 49 KB on the wire; kept a Buffer each, with
    // the socket's reads they share, they were counted (and held) as 32 MiB.
    const routes = webhookRoutes({ pool: unreachable, gateway: undefined as never, log, secrets: [SECRET], bodyDeadlineMs: 3_000 });
    const server = await startHttpServer(0, routes, '127.0.0.1', log);
    try {
      const unfinished = `POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n${'1\r\nx\r\n'.repeat(8_190)}`;
      const held = [1, 2, 3].map(() => rawRequest(server.port, unfinished, { timeoutMs: 10_000 }));
      await new Promise((r) => setTimeout(r, 500));
      expect((await post(server.port, JSON.stringify({ id: 'evt_genuine', padding: 'x'.repeat(8_000) }))).status).toBe(400); // read, its signature refused
      for (const t of await Promise.all(held)) expect(t).toMatchObject({ status: null, closed: true });
    } finally {
      await server.close();
    }
  });

  it('connections that send no body hold nothing: a request beside twenty of them is read at once', async () => {
    const routes = webhookRoutes({ pool: unreachable, gateway: undefined as never, log, secrets: [SECRET], bodyDeadlineMs: 1_500 });
    const server = await startHttpServer(0, routes, '127.0.0.1', log);
    try {
      const idle = Array.from({ length: 20 }, () => rawRequest(server.port, 'POST /webhooks/stripe HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n', { timeoutMs: 10_000 }));
      expect((await post(server.port, '{}')).status).toBe(400);
      await Promise.all(idle);
    } finally {
      await server.close();
    }
  });

  it('handles a bounded number of signed events at once (beyond: 503), each waiting for the pool', async () => {
    const [db, emu] = await Promise.all([createTestDatabase(), startEmulator()]);
    const pool = createPool(db.url, { schema: 'outboxd', max: 1 });
    const client = await pool.connect(); // the pool's one connection: each event waits for it
    let released = false;
    const release = () => {
      if (!released) client.release();
      released = true;
    };
    const routes = webhookRoutes({ pool, gateway: emu.gateway(), log, secrets: [SECRET], maxHandling: 2 });
    const server = await startHttpServer(0, routes, '127.0.0.1', log);
    try {
      const event = (id: string) => JSON.stringify({ id, object: 'event', type: 'payment_intent.succeeded', created: 1_700_000_000, livemode: false, data: { object: { id: 'pi_none', object: 'payment_intent', status: 'succeeded', metadata: {} } } });
      const signedPost = (id: string) => post(server.port, event(id), Stripe.webhooks.generateTestHeaderString({ payload: event(id), secret: SECRET }));
      const waiting = [signedPost('evt_wait_1'), signedPost('evt_wait_2')];
      let refused: Response | undefined;
      await expect.poll(async () => (refused = await signedPost('evt_third')).status, { timeout: 2_000 }).toBe(503);
      expect(await refused!.json()).toMatchObject({ error: 'busy', message: expect.stringMatching(/2 webhook events in progress/) });
      release();
      expect((await Promise.all(waiting)).map((r) => r.status)).toEqual([200, 200]);
      expect((await signedPost('evt_third')).status).toBe(200);
    } finally {
      release();
      await server.close();
      await pool.end();
      await Promise.all([db.close(), emu.close()]);
    }
  });
});

describe('500s', () => {
  it('outside the admin API a 500 says only "internal error"; the cause is logged', async () => {
    const res = await fetch(`${base}/boom`);
    expect(res.status).toBe(500);
    expect(await res.json()).toEqual({ error: 'internal', message: 'internal error' });
    const entry = logged.find((l) => l.msg === 'HTTP handler failed' && l.path === '/boom') as { err: { message: string } } | undefined;
    expect(entry?.err.message).toMatch(/secret_table/);
    expect((await fetch(`${base}/teapot`).then((r) => r.json()))).toEqual({ error: 'teapot', message: 'short and stout' });
  });

  it('the webhook endpoint hides a database failure; the admin API shows it to the token holder', async () => {
    const payload = JSON.stringify({ id: 'evt_1', object: 'event', type: 'payment_intent.succeeded', data: { object: { id: 'pi_1', metadata: {} } } });
    const hook = await fetch(`${base}/webhooks/stripe`, {
      method: 'POST',
      headers: { 'Stripe-Signature': Stripe.webhooks.generateTestHeaderString({ payload, secret: SECRET }) },
      body: payload,
    });
    expect(hook.status).toBe(500);
    const hookBody = await hook.text();
    expect(hookBody).toBe('{"error":"internal","message":"internal error"}');

    const admin = await fetch(`${base}/admin/operations`, { headers: { Authorization: `Bearer ${TOKEN}` } });
    expect(admin.status).toBe(500);
    expect(await admin.json()).toMatchObject({ error: 'internal', message: expect.stringMatching(/ECONNREFUSED/) });
    expect((await fetch(`${base}/admin/operations`)).status).toBe(401);
  });
});
