// Traces of one payment, recorded in memory by an SDK registered for this file (each test file runs in a
// process of its own): the confirming transaction, the relay, the dispatch, the claim, the Stripe call
// (the real SDK over HTTP to the emulator) and the outcome in one trace; later attempts in traces of
// their own that link to it; nothing secret in any of them; log lines that name their span.
import { execFile } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { promisify } from 'node:util';
import { context, propagation, trace, type Attributes } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { InMemorySpanExporter, SimpleSpanProcessor, TracerProvider, type ReadableSpan } from '@opentelemetry/sdk-trace';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import type Stripe from 'stripe';
import { requeueOperation } from '../../src/admin/requeue.ts';
import { resolveOperation } from '../../src/admin/resolve.ts';
import { Outboxd } from '../../src/index.ts';
import { createLogger } from '../../src/telemetry/log.ts';
import { confirmOrder } from '../../src/exampleApp/confirm.ts';
import { traceContextPropagator } from '../../src/telemetry/tracing.ts';
import { receiveStripeEvent } from '../../src/webhooks/inbox.ts';
import { waitUntil } from '../../harness/replica.ts';
import { createTestDatabase, type TestDb } from '../support/db.ts';
import { startDispatcher, type InProcessReplica } from '../support/dispatcher.ts';
import { startEmulator, TEST_KEY, type RunningEmulator } from '../support/emulator.ts';
import { operation, orderInput } from '../support/fixtures.ts';

let t: TestDb;
let e: RunningEmulator;
let replica: InProcessReplica | undefined;
const exporter = new InMemorySpanExporter();
const provider = new TracerProvider({ spanProcessors: [new SimpleSpanProcessor({ exporter })] });
/** Every span any test finished: the last test checks them all for secrets. */
const everySpan: ReadableSpan[] = [];
const logLines: Record<string, unknown>[] = [];
const log = createLogger('info', {}, { write: (line: string) => void logLines.push(JSON.parse(line)) });

beforeAll(async () => {
  [t, e] = await Promise.all([createTestDatabase(), startEmulator()]);
});
afterEach(async () => {
  await replica?.stop();
  replica = undefined;
  // What a failed test left to drive must not be driven in the next one.
  await t.pool.query(`delete from pgboss.job where name in ('charge', 'charge_dead')`);
  await t.pool.query('delete from outboxd.charge_outbox');
  everySpan.push(...exporter.getFinishedSpans());
  exporter.reset();
});
afterAll(async () => {
  await Promise.all([t.close(), e.close()]);
  await provider.shutdown();
});

const settled = (id: string) => waitUntil(async () => ['succeeded', 'failed'].includes((await operation(t, id)).status), 20_000, `operation ${id} to settle`);
const named = (spans: ReadableSpan[], name: string) => spans.filter((s) => s.name === name);
const one = (spans: ReadableSpan[], name: string) => {
  const found = named(spans, name);
  expect(found.map((s) => s.name), name).toEqual([name]);
  return found[0]!;
};
const parentOf = (span: ReadableSpan) => span.parentSpanContext?.spanId;
const ofOperation = (id: string) => exporter.getFinishedSpans().filter((s) => s.attributes['outboxd.operation_id'] === id);

describe('with no SDK registered (tracing off)', () => {
  it('the library (src/index.ts) loads no SDK: only the API, so an application\'s own SDK gets its spans', async () => {
    // Every module the library's entry point resolves, recorded by a resolve hook in a fresh process.
    const script = `
      import { registerHooks } from 'node:module';
      const seen = [];
      registerHooks({ resolve: (specifier, context, next) => (seen.push(specifier), next(specifier, context)) });
      await import(${JSON.stringify(new URL('../../src/index.ts', import.meta.url).href)});
      console.log(JSON.stringify(seen));`;
    const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', script], { timeout: 30_000 });
    const seen: string[] = JSON.parse(stdout);
    expect(seen).toContain('@opentelemetry/api');
    expect(seen.filter((s) => /tracingSdk|@opentelemetry\/(sdk-|exporter-|context-|resources)/.test(s))).toEqual([]);
  });

  it('stores no trace context and logs no trace ids', async () => {
    const order = orderInput();
    const { operationId } = await confirmOrder(t.pool, order);
    expect((await operation(t, operationId)).traceparent).toBeNull();
    const { rows } = await t.pool.query('select traceparent from outboxd.charge_outbox where operation_id = $1', [operationId]);
    expect(rows).toEqual([{ traceparent: null }]);
    replica = await startDispatcher(t, e.gateway(), 'untraced', { log });
    await settled(operationId);
    const line = logLines.find((l) => l.msg === 'gateway call finished' && l.orderId === order.orderId);
    expect(line).toBeDefined();
    expect(line).not.toHaveProperty('trace_id');
    expect(exporter.getFinishedSpans()).toEqual([]);
  });
});

describe('with an SDK registered', () => {
  beforeAll(() => {
    context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
    propagation.setGlobalPropagator(traceContextPropagator);
    trace.setGlobalTracerProvider(provider);
  });

  it("the library's requestCharge is a span of the application's active trace, whose context the operation keeps", async () => {
    const outboxd = new Outboxd({ pool: t.pool, schema: t.schema });
    const client = await t.pool.connect();
    try {
      const app = trace.getTracer('the-application');
      const { operationId } = await app.startActiveSpan('POST /checkout', async (checkout) => {
        await client.query('begin');
        const requested = await outboxd.requestCharge(client, { orderId: `app-${randomUUID()}`, amount: 990, currency: 'eur', customer: 'cus_app', paymentMethod: 'pm_card_visa' });
        await client.query('commit');
        checkout.end();
        return requested;
      });
      const checkout = one(exporter.getFinishedSpans(), 'POST /checkout');
      const request = one(exporter.getFinishedSpans(), 'outboxd.request_charge');
      expect(request.spanContext().traceId).toBe(checkout.spanContext().traceId);
      expect(parentOf(request)).toBe(checkout.spanContext().spanId);
      expect((await operation(t, operationId)).traceparent).toBe(`00-${request.spanContext().traceId}-${request.spanContext().spanId}-01`);
    } finally {
      client.release();
    }
  });

  it('one trace joins the confirming transaction to the Stripe call and its outcome', async () => {
    const order = orderInput();
    const { operationId } = await confirmOrder(t.pool, order);
    const confirm = one(exporter.getFinishedSpans(), 'outboxd.confirm');
    const request = one(exporter.getFinishedSpans(), 'outboxd.request_charge');
    expect(request.attributes).toMatchObject({ 'outboxd.operation_id': operationId, 'outboxd.order_id': order.orderId, 'outboxd.kind': 'charge', 'outboxd.created': true });
    expect(parentOf(request)).toBe(confirm.spanContext().spanId);
    // The operation and its outbox row keep the request's context.
    const { traceId, spanId } = request.spanContext();
    expect((await operation(t, operationId)).traceparent).toBe(`00-${traceId}-${spanId}-01`);

    replica = await startDispatcher(t, e.gateway(), 'traced', { log });
    await settled(operationId);
    await waitUntil(() => named(exporter.getFinishedSpans(), 'outboxd.dispatch').length === 1, 5_000, 'the dispatch span to end');
    const payment = exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === traceId);
    const relay = one(payment, 'outboxd.relay');
    const dispatch = one(payment, 'outboxd.dispatch');
    const claim = one(payment, 'outboxd.claim');
    const gatewayCall = one(payment, 'outboxd.gateway');
    const http = one(payment, 'POST /v1/payment_intents');
    const outcome = one(payment, 'outboxd.record_outcome');
    expect(parentOf(relay)).toBe(spanId);
    expect(parentOf(dispatch)).toBe(relay.spanContext().spanId);
    // pg-boss's own `process` span, a trace of its own, stays one link away (it ends once pg-boss has
    // the batch's results, a moment after the dispatch span).
    await waitUntil(() => named(exporter.getFinishedSpans(), 'process charge').length === 1, 5_000, 'the process span to end');
    const process = one(exporter.getFinishedSpans(), 'process charge');
    expect(dispatch.links.map((l) => [l.context.spanId, l.attributes?.['outboxd.link']])).toEqual([[process.spanContext().spanId, 'delivery']]);
    for (const child of [claim, gatewayCall, outcome]) expect(parentOf(child)).toBe(dispatch.spanContext().spanId);
    expect(parentOf(http)).toBe(gatewayCall.spanContext().spanId);
    // pg-boss completes the job after the outcome, in its own `process` span.
    expect(parentOf(one(exporter.getFinishedSpans(), 'complete charge'))).toBe(process.spanContext().spanId);

    const ids = { 'outboxd.operation_id': operationId, 'outboxd.order_id': order.orderId, 'outboxd.kind': 'charge', 'outboxd.fence': 1 };
    expect(dispatch.attributes).toMatchObject(ids);
    expect(claim.attributes).toMatchObject({ 'outboxd.operation_id': operationId, 'outboxd.fence': 1, 'outboxd.claimed': true });
    expect(gatewayCall.attributes).toMatchObject({ ...ids, 'outboxd.attempt': 1, 'outboxd.call': 'create', 'outboxd.outcome': 'succeeded' });
    expect(outcome.attributes).toMatchObject({ ...ids, 'outboxd.attempt': 1, 'outboxd.outcome': 'succeeded', 'outboxd.status': 'succeeded' });
    const create = e.emulator.requests().find((r) => r.endpoint === 'create' && r.operationId === operationId)!;
    expect(http.attributes).toMatchObject({
      'http.request.method': 'POST',
      'http.response.status_code': 200,
      'stripe.request_id': create.requestId,
      'url.template': '/v1/payment_intents',
      'server.address': '127.0.0.1',
      'url.full': `${e.url}/v1/payment_intents`,
    });

    // Its log lines name the span they were written in.
    const line = logLines.find((l) => l.msg === 'gateway call finished' && l.orderId === order.orderId);
    expect(line).toMatchObject({ trace_id: traceId, span_id: dispatch.spanContext().spanId });
  });

  it("each settlement event's delivery to onSettled is a span linked to the payment's trace", async () => {
    const outboxd = new Outboxd({ pool: t.pool, schema: t.schema });
    const heard: string[] = [];
    await outboxd.onSettled(async (event) => void heard.push(event.operationId));
    try {
      const { operationId } = await confirmOrder(t.pool, orderInput());
      const request = one(exporter.getFinishedSpans(), 'outboxd.request_charge');
      replica = await startDispatcher(t, e.gateway(), 'traced', { log });
      await waitUntil(async () => heard.includes(operationId), 20_000, 'the settlement event');
      const delivered = () => named(ofOperation(operationId), 'outboxd.settlement_delivery');
      await waitUntil(async () => delivered().length === 1, 5_000, 'the delivery span to end');
      const delivery = delivered()[0]!;
      expect(delivery.attributes).toMatchObject({ 'outboxd.kind': 'charge', 'outboxd.status': 'succeeded', 'outboxd.source': 'dispatcher', 'outboxd.delivery_retry': 0 });
      expect(delivery.links.map((l) => l.context.traceId)).toContain(request.spanContext().traceId);
    } finally {
      await outboxd.stop();
    }
  });

  it('a retry is a trace of its own that links to the payment, and shows the failed call', async () => {
    const order = orderInput();
    const { operationId } = await confirmOrder(t.pool, order);
    const { traceId } = one(exporter.getFinishedSpans(), 'outboxd.confirm').spanContext();
    // The first create gets a 500 (nothing charged): ambiguous, so pg-boss retries the job, same key.
    e.emulator.addFault({ match: { operationId }, fault: { kind: 'error_before_commit', status: 500 } });
    replica = await startDispatcher(t, e.gateway(), 'retrying', { log });
    await settled(operationId);
    await waitUntil(() => named(ofOperation(operationId), 'outboxd.dispatch').length === 2, 5_000, 'both dispatch spans to end');

    const [first, second] = named(ofOperation(operationId), 'outboxd.dispatch').sort((a, b) => a.startTime[0] - b.startTime[0] || a.startTime[1] - b.startTime[1]);
    expect(first!.spanContext().traceId).toBe(traceId);
    const inRetry = () => exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === second!.spanContext().traceId);
    // The job's own span ends after the dispatch span inside it: on a loaded machine, a moment later.
    await waitUntil(() => named(inRetry(), 'process charge').length > 0, 5_000, "the retry's job span to end");
    const retry = inRetry();
    expect(second!.spanContext().traceId).not.toBe(traceId);
    expect(second!.links.map((l) => [l.context.traceId, l.attributes?.['outboxd.link']])).toContainEqual([traceId, 'confirmation']);
    // It stays in the trace pg-boss delivered it in, which begins there: the relay stored no context of
    // its own on the job (one for a whole batch of payments would join them all in one trace).
    const process = one(retry, 'process charge');
    expect(parentOf(second!)).toBe(process.spanContext().spanId);
    expect(parentOf(process)).toBeUndefined();
    expect(one(retry, 'outboxd.gateway').attributes).toMatchObject({ 'outboxd.attempt': 2, 'outboxd.outcome': 'succeeded' });

    const failed = one(exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === traceId), 'POST /v1/payment_intents');
    expect(failed.attributes).toMatchObject({ 'http.response.status_code': 500, 'error.type': '500' });
    expect(failed.status.code).toBe(2); // ERROR
    expect(one(exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === traceId), 'outboxd.gateway').attributes['outboxd.outcome']).toBe('ambiguous');
  });

  it('a 429 reschedules a fresh job whose attempt links to the payment rather than nesting in it', async () => {
    const { operationId } = await confirmOrder(t.pool, orderInput());
    const { traceId } = one(exporter.getFinishedSpans(), 'outboxd.confirm').spanContext();
    e.emulator.addFault({ match: { operationId }, fault: { kind: 'rate_limit' } });
    replica = await startDispatcher(t, e.gateway(), 'rate-limited', { log });
    await settled(operationId);
    await waitUntil(() => named(ofOperation(operationId), 'outboxd.dispatch').length === 2, 5_000, 'both dispatch spans to end');
    const outcomes = named(ofOperation(operationId), 'outboxd.gateway').map((s) => [s.spanContext().traceId === traceId, s.attributes['outboxd.outcome']]);
    expect(outcomes.sort()).toEqual([[false, 'succeeded'], [true, 'rate_limited']]);
    const later = named(ofOperation(operationId), 'outboxd.dispatch').find((s) => s.spanContext().traceId !== traceId)!;
    expect(later.links.map((l) => l.context.traceId)).toContain(traceId);
  });

  it("a requeued job is driven in the requeue's trace (pg-boss propagates it), linked to the payment's", async () => {
    const { operationId } = await confirmOrder(t.pool, orderInput());
    const { traceId } = one(exporter.getFinishedSpans(), 'outboxd.confirm').spanContext();
    await t.pool.query('delete from outboxd.charge_outbox where operation_id = $1', [operationId]); // nothing drives it now
    expect(await requeueOperation(t.pool, t.boss, operationId, { actor: 'test' })).toMatchObject({ result: 'requeued' });
    const requeue = one(exporter.getFinishedSpans(), 'outboxd.requeue');
    expect(requeue.spanContext().traceId).not.toBe(traceId);
    expect(requeue.links.map((l) => l.context.traceId)).toEqual([traceId]);

    replica = await startDispatcher(t, e.gateway(), 'requeued', { log });
    await settled(operationId);
    await waitUntil(() => named(ofOperation(operationId), 'outboxd.dispatch').length === 1, 5_000, 'the dispatch span to end');
    const dispatch = one(ofOperation(operationId), 'outboxd.dispatch');
    expect(dispatch.spanContext().traceId).toBe(requeue.spanContext().traceId);
    expect(dispatch.links.map((l) => l.context.traceId)).toContain(traceId);
    const inTrace = () => exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === requeue.spanContext().traceId);
    await waitUntil(() => named(inTrace(), 'process charge').length === 1, 5_000, 'the process span to end');
    const inRequeue = inTrace();
    const send = one(inRequeue, 'send charge');
    expect(parentOf(send)).toBe(requeue.spanContext().spanId);
    expect(parentOf(one(inRequeue, 'process charge'))).toBe(send.spanContext().spanId);
  });

  it("a person's resolution and a Stripe webhook are traces of their own, linked to the payment's", async () => {
    const order = orderInput();
    const { operationId } = await confirmOrder(t.pool, order);
    const { traceId } = one(exporter.getFinishedSpans(), 'outboxd.confirm').spanContext();
    await t.pool.query('delete from outboxd.charge_outbox where operation_id = $1', [operationId]); // no worker drives it
    const pi = await e.client().paymentIntents.create({ amount: order.amount, currency: order.currency, customer: order.customer, payment_method: 'pm_card_visa', confirm: true, metadata: { operation_id: operationId } });
    const opts = { leaseTtlMs: 10_000, searchFreshnessSeconds: 0 };
    await resolveOperation(t.pool, e.gateway(), operationId, { outcome: 'succeeded', externalId: pi.id }, 'tester', opts);
    const resolve = one(exporter.getFinishedSpans(), 'outboxd.resolve');
    expect(resolve.spanContext().traceId).not.toBe(traceId);
    expect(resolve.links.map((l) => l.context.traceId)).toEqual([traceId]);
    expect(resolve.attributes).toMatchObject({ 'outboxd.operation_id': operationId, 'outboxd.order_id': order.orderId, 'outboxd.resolution': 'succeeded', 'outboxd.actor': 'tester' });
    const inResolve = exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === resolve.spanContext().traceId);
    expect(parentOf(one(inResolve, 'outboxd.claim'))).toBe(resolve.spanContext().spanId);
    expect(one(inResolve, 'GET /v1/payment_intents/{id}').attributes['stripe.request_id']).toMatch(/^req_/);

    const event = { id: `evt_${randomUUID().replaceAll('-', '')}`, type: 'payment_intent.succeeded', data: { object: { id: pi.id } } } as unknown as Stripe.Event;
    expect(await receiveStripeEvent({ pool: t.pool, gateway: e.gateway(), log }, event)).toBe('already_settled');
    const webhook = one(exporter.getFinishedSpans(), 'outboxd.webhook');
    expect(webhook.links.map((l) => l.context.traceId)).toEqual([traceId]);
    expect(webhook.attributes).toMatchObject({ 'stripe.event.id': event.id, 'stripe.event.type': event.type, 'outboxd.webhook.result': 'already_settled', 'outboxd.operation_id': operationId });
  });

  it('a declined card: its 402 and the failed outcome, recorded without the card', async () => {
    const { operationId } = await confirmOrder(t.pool, orderInput({ paymentMethod: 'pm_card_chargeDeclined' }));
    replica = await startDispatcher(t, e.gateway(), 'declined', { log });
    await settled(operationId);
    await waitUntil(() => named(ofOperation(operationId), 'outboxd.record_outcome').length === 1, 5_000, 'the outcome span to end');
    expect(one(ofOperation(operationId), 'outboxd.record_outcome').attributes).toMatchObject({ 'outboxd.outcome': 'failed', 'outboxd.status': 'failed' });
    const http = one(exporter.getFinishedSpans(), 'POST /v1/payment_intents');
    expect(http.attributes).toMatchObject({ 'http.response.status_code': 402, 'error.type': '402' });
    expect(http.attributes['stripe.request_id']).toMatch(/^req_/);
  });

  it('no span carries the secret key, a payment method or a customer', () => {
    expect(everySpan.length).toBeGreaterThan(30);
    const attributeSets = (s: ReadableSpan): (Attributes | undefined)[] => [
      s.attributes,
      s.resource.attributes as Attributes,
      ...s.events.map((ev) => ev.attributes),
      ...s.links.map((l) => l.attributes),
    ];
    for (const span of everySpan) {
      const text = JSON.stringify([span.name, attributeSets(span), span.status]);
      expect(text, span.name).not.toMatch(new RegExp(`${TEST_KEY}|sk_(test|live)_|pm_card|cus_test`));
    }
  });
});
