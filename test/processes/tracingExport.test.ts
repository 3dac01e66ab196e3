// Traces leaving real processes for a real OTLP/HTTP receiver (a node:http server in this test that
// decodes and keeps what is POSTed to /v1/traces): a worker started with the standard variables sends
// its spans over http/json in the trace of an order confirmed here, and the CLI sends over http/protobuf
// before it exits.
import { execFile } from 'node:child_process';
import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { context, propagation, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { InMemorySpanExporter, SimpleSpanProcessor, TracerProvider } from '@opentelemetry/sdk-trace';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { confirmOrder } from '../../src/exampleApp/confirm.ts';
import { traceContextPropagator } from '../../src/telemetry/tracing.ts';
import { startReplica, waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startEmulator, type RunningEmulator } from '../support/emulator.ts';
import { operation, orderInput } from '../support/fixtures.ts';

const BIN = fileURLToPath(new URL('../../bin/outboxd.js', import.meta.url));

/** A span as OTLP/JSON carries it, with its attributes as a plain object and its resource's. */
interface ReceivedSpan {
  traceId: string;
  spanId: string;
  parentSpanId?: string;
  name: string;
  attributes: Record<string, unknown>;
  resource: Record<string, unknown>;
}

interface Receiver {
  url: string;
  /** Every request: its content type and raw body. */
  requests: { contentType: string; body: Buffer }[];
  /** The spans of every http/json request. */
  spans: ReceivedSpan[];
  close(): Promise<void>;
}

type KeyValue = { key: string; value: Record<string, unknown> };
const plain = (kvs: KeyValue[] = []) => Object.fromEntries(kvs.map(({ key, value }) => [key, Object.values(value)[0]]));

async function startReceiver(): Promise<Receiver> {
  const requests: Receiver['requests'] = [];
  const spans: ReceivedSpan[] = [];
  const server: Server = createServer(async (req, res) => {
    const chunks: Buffer[] = [];
    for await (const chunk of req) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    const contentType = String(req.headers['content-type'] ?? '');
    if (req.method !== 'POST' || req.url !== '/v1/traces') {
      res.writeHead(404).end();
      return;
    }
    requests.push({ contentType, body });
    if (contentType.startsWith('application/json')) {
      for (const rs of JSON.parse(body.toString('utf8')).resourceSpans ?? []) {
        const resource = plain(rs.resource?.attributes);
        for (const ss of rs.scopeSpans ?? []) for (const s of ss.spans ?? []) spans.push({ ...s, attributes: plain(s.attributes), resource });
      }
    }
    // An empty ExportTraceServiceResponse: all accepted.
    res.writeHead(200, { 'Content-Type': contentType.startsWith('application/json') ? 'application/json' : 'application/x-protobuf' });
    res.end(contentType.startsWith('application/json') ? '{}' : undefined);
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    requests,
    spans,
    close: () => new Promise((resolve) => server.close(() => resolve())),
  };
}

/** `promise`, or a failure after `ms`: every wait here is bounded. */
function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), ms)));
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

let t: TestDb;
let e: RunningEmulator;
let receiver: Receiver;
// This process traces too (in memory): the order is confirmed here, and the worker must continue its trace.
const exporter = new InMemorySpanExporter();
const provider = new TracerProvider({ spanProcessors: [new SimpleSpanProcessor({ exporter })] });

beforeAll(async () => {
  [t, e, receiver] = await Promise.all([createTestDatabase(), startEmulator(), startReceiver()]);
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  propagation.setGlobalPropagator(traceContextPropagator);
  trace.setGlobalTracerProvider(provider);
});
afterAll(async () => {
  await Promise.all([t.close(), e.close(), receiver.close(), provider.shutdown()]);
});

describe('export to a real OTLP/HTTP receiver', () => {
  it("a worker process sends its spans over http/json, in the trace of the order's confirming transaction", async () => {
    const worker = await startReplica({
      DATABASE_URL: t.url,
      STRIPE_API_BASE: e.url,
      STRIPE_SECRET_KEY: '',
      HTTP_HOST: '127.0.0.1',
      OTEL_EXPORTER_OTLP_ENDPOINT: receiver.url,
      OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json',
      OTEL_SERVICE_NAME: 'outboxd-e2e',
    });
    try {
      const order = orderInput();
      const { operationId } = await confirmOrder(t.pool, order);
      const request = exporter.getFinishedSpans().find((s) => s.name === 'outboxd.request_charge')!;
      const { traceId } = request.spanContext();
      await waitUntil(async () => (await operation(t, operationId)).status === 'succeeded', 30_000, 'the charge to succeed');
      // A drained worker exports what it still buffers before it exits.
      worker.kill('SIGTERM');
      expect((await within(worker.exited, 30_000, 'the worker to exit')).code).toBe(0);

      const spans = receiver.spans.filter((s) => s.traceId === traceId);
      const named = (name: string) => {
        const found = spans.filter((s) => s.name === name);
        expect(found.map((s) => s.name), name).toEqual([name]);
        return found[0]!;
      };
      const relay = named('outboxd.relay');
      const dispatch = named('outboxd.dispatch');
      const gatewayCall = named('outboxd.gateway');
      const http = named('POST /v1/payment_intents');
      expect(relay.parentSpanId).toBe(request.spanContext().spanId);
      expect(dispatch.parentSpanId).toBe(relay.spanId);
      expect(named('outboxd.claim').parentSpanId).toBe(dispatch.spanId);
      expect(gatewayCall.parentSpanId).toBe(dispatch.spanId);
      expect(http.parentSpanId).toBe(gatewayCall.spanId);
      expect(named('outboxd.record_outcome').attributes).toMatchObject({ 'outboxd.operation_id': operationId, 'outboxd.order_id': order.orderId, 'outboxd.status': 'succeeded' });
      const create = e.emulator.requests().find((r) => r.endpoint === 'create' && r.operationId === operationId)!;
      expect(http.attributes).toMatchObject({ 'http.request.method': 'POST', 'http.response.status_code': 200, 'stripe.request_id': create.requestId });
      for (const s of spans) expect(s.resource).toMatchObject({ 'service.name': 'outboxd-e2e' });
      expect(new Set(receiver.requests.map((r) => r.contentType))).toEqual(new Set(['application/json']));

      // The worker's log lines about the call carry the same trace.
      const line = worker.logs.find((l) => l.msg === 'gateway call finished' && l.orderId === order.orderId);
      expect(line).toMatchObject({ trace_id: traceId, span_id: dispatch.spanId });
    } finally {
      worker.kill('SIGKILL');
    }
  });

  it('the CLI sends its spans over http/protobuf before it exits', async () => {
    const before = receiver.requests.length;
    const order = orderInput();
    const { stdout } = await promisify(execFile)(
      process.execPath,
      [BIN, 'order', 'confirm', '--order-id', order.orderId, '--amount', '1200', '--currency', 'eur', '--customer', 'cus_cli', '--payment-method', 'pm_card_visa', '--json'],
      {
        env: { ...process.env, DATABASE_URL: t.url, LOG_LEVEL: 'warn', OTEL_EXPORTER_OTLP_ENDPOINT: receiver.url, OTEL_EXPORTER_OTLP_PROTOCOL: 'http/protobuf' },
        timeout: 30_000,
      },
    );
    const { traceparent } = await operation(t, JSON.parse(stdout).operationId);
    const [, traceId, spanId] = traceparent!.split('-');
    const sent = receiver.requests.slice(before);
    expect(sent.map((r) => r.contentType)).toEqual(['application/x-protobuf']);
    // Protobuf carries ids as raw bytes and names as UTF-8: the request_charge span whose context the
    // operation stored, and the confirm span around it.
    const body = sent[0]!.body;
    expect(body.includes(Buffer.from(traceId!, 'hex'))).toBe(true);
    expect(body.includes(Buffer.from(spanId!, 'hex'))).toBe(true);
    expect(body.includes(Buffer.from('outboxd.confirm'))).toBe(true);
  });

  it('a collector that never answers does not hold the CLI: it exits without the spans', async () => {
    const silent = createServer(() => {}); // accepts, reads, never answers
    silent.listen(0, '127.0.0.1');
    await once(silent, 'listening');
    try {
      const order = orderInput();
      // The exporter would wait a minute for the answer (its own OTEL_EXPORTER_OTLP_TIMEOUT); the CLI
      // must be gone long before the 30 s this test gives it.
      const { stdout, stderr } = await promisify(execFile)(
        process.execPath,
        [BIN, 'order', 'confirm', '--order-id', order.orderId, '--amount', '1200', '--currency', 'eur', '--customer', 'cus_cli', '--payment-method', 'pm_card_visa', '--json'],
        {
          env: {
            ...process.env,
            DATABASE_URL: t.url,
            LOG_LEVEL: 'warn',
            OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${(silent.address() as AddressInfo).port}`,
            OTEL_EXPORTER_OTLP_TIMEOUT: '60000',
          },
          timeout: 30_000,
        },
      );
      expect(JSON.parse(stdout)).toMatchObject({ created: true });
      expect(stderr).toContain('spans not exported within');
    } finally {
      silent.closeAllConnections();
      silent.close();
    }
  });
});
