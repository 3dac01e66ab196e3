// Traces, through the OpenTelemetry API (and core's W3C propagator, which registers and starts nothing,
// loaded only once there is a trace context to carry).
// The spans go to whatever SDK the process registered: the application's own (the library starts none),
// or the one `outboxd` starts when OTEL_EXPORTER_OTLP_ENDPOINT is set (src/telemetry/tracingSdk.ts). With none
// registered the API is a no-op: no context is kept, every span is a non-recording one, and nothing is
// stored on the rows.
//
// One payment's story: the confirming transaction stores its trace context (W3C traceparent) on the
// operation and its outbox row; the relay and the first dispatch continue that trace, so it joins the
// order's transaction to the Stripe call. Every later attempt (a retry, a requeue, the reconcile sweep,
// a webhook, a resolution) is a trace of its own that LINKS to it: a trace that grew for hours or days
// would be cut or dropped by most backends.
import { createRequire } from 'node:module';
import {
  context,
  createContextKey,
  defaultTextMapGetter,
  defaultTextMapSetter,
  isSpanContextValid,
  ROOT_CONTEXT,
  SpanKind,
  SpanStatusCode,
  trace,
  type Attributes,
  type Context,
  type Link,
  type Span,
  type TextMapGetter,
  type TextMapPropagator,
  type TextMapSetter,
} from '@opentelemetry/api';
import { messageOf } from '../types/input.ts';

const tracer = trace.getTracer('outboxd');

/** Span attributes of an operation: every span about one carries them, so one query finds them all. */
export const ATTR = {
  operationId: 'outboxd.operation_id',
  orderId: 'outboxd.order_id',
  kind: 'outboxd.kind',
  /** The kind's policy on an ambiguous outcome (src/engine/kinds.ts). */
  policy: 'outboxd.policy',
  fence: 'outboxd.fence',
  attempt: 'outboxd.attempt',
  /** create, retrieve or search */
  call: 'outboxd.call',
  /** What a gateway call meant (succeeded, failed, ambiguous, rate_limited, …). */
  outcome: 'outboxd.outcome',
  status: 'outboxd.status',
} as const;

/** The attributes of an operation's spans under a claim (an application's own kind has no order). */
export function operationAttributes(op: { id: string; order_id: string | null; kind: string }, fence: number): Attributes {
  return { [ATTR.operationId]: op.id, ...(op.order_id ? { [ATTR.orderId]: op.order_id } : {}), [ATTR.kind]: op.kind, [ATTR.fence]: fence };
}

/** Records what a call meant on its span, passing the outcome on. */
export const outcomeOn =
  (span: Span) =>
  <T extends { kind: string }>(outcome: T): T => {
    span.setAttribute(ATTR.outcome, outcome.kind);
    return outcome;
  };

/**
 * Trace ids only: baggage could carry anything an application put there, and these are kept in tables.
 * Core's W3C propagator, loaded the first time there is a context to inject (a valid span context: an
 * SDK is registered) or a traceparent to extract: a process that traces nothing never loads
 * @opentelemetry/core (~2 MB of a replica's RSS, measured in npm run bench). Both shortcuts are the
 * propagator's own first steps.
 */
export const traceContextPropagator: TextMapPropagator = {
  inject(ctx: Context, carrier: unknown, setter: TextMapSetter) {
    const sc = trace.getSpanContext(ctx);
    if (sc && isSpanContextValid(sc)) w3cPropagator().inject(ctx, carrier, setter);
  },
  extract(ctx: Context, carrier: unknown, getter: TextMapGetter) {
    return getter.get(carrier, 'traceparent') ? w3cPropagator().extract(ctx, carrier, getter) : ctx;
  },
  fields: () => w3cPropagator().fields(),
};

let w3c: TextMapPropagator | undefined;
function w3cPropagator(): TextMapPropagator {
  if (!w3c) {
    // Synchronous, as inject and extract are: core's CommonJS build, through require. Bound to a name
    // first: `new (require(…) as T).C()` compiles to `new require(…).C()`, which calls the wrong thing.
    const core = createRequire(import.meta.url)('@opentelemetry/core') as typeof import('@opentelemetry/core');
    w3c = new core.W3CTraceContextPropagator();
  }
  return w3c;
}

/** Core's suppressTracing key, which every SDK checks: the API makes keys with Symbol.for, so this is
 * the same key (so that copies of core agree), without loading core (test/unit/tracingLazy.test.ts). */
const SUPPRESS_TRACING = createContextKey('OpenTelemetry SDK Context Key SUPPRESS_TRACING');

export interface SpanOptions {
  kind?: SpanKind;
  /** Default: the active context. */
  parent?: Context;
  links?: Link[];
}

/**
 * Runs `fn` in a new active span: ended when `fn` settles, with an error status (and the error's type)
 * when it throws. `fn` may add attributes it learns on the way (span.setAttribute).
 */
export function withSpan<T>(name: string, attributes: Attributes, fn: (span: Span) => Promise<T>, opts: SpanOptions = {}): Promise<T> {
  const parent = opts.parent ?? context.active();
  const span = tracer.startSpan(name, { kind: opts.kind ?? SpanKind.INTERNAL, attributes, links: opts.links ?? [] }, parent);
  return context.with(trace.setSpan(parent, span), async () => {
    try {
      return await fn(span);
    } catch (err) {
      markFailed(span, err);
      throw err;
    } finally {
      span.end();
    }
  });
}

/** An error status with the error's type (its code, e.g. ECONNRESET, or its class) and message. */
export function markFailed(span: Span, err: unknown): void {
  const e = err as { code?: unknown; name?: unknown; message?: unknown } | null;
  const type = typeof e?.code === 'string' ? e.code : typeof e?.name === 'string' ? e.name : '_OTHER';
  span.setAttribute('error.type', type);
  span.setStatus({ code: SpanStatusCode.ERROR, message: messageOf(err) });
}

/** The active span's traceparent, to store with what it created; null when nothing is traced. */
export function activeTraceparent(): string | null {
  const carrier: Record<string, string> = {};
  traceContextPropagator.inject(context.active(), carrier, defaultTextMapSetter);
  return carrier.traceparent ?? null;
}

/** A stored traceparent as a (remote) parent context; undefined when absent or malformed. */
export function contextOf(traceparent: unknown): Context | undefined {
  if (typeof traceparent !== 'string') return undefined;
  const ctx = traceContextPropagator.extract(ROOT_CONTEXT, { traceparent }, defaultTextMapGetter);
  const sc = trace.getSpanContext(ctx);
  return sc && isSpanContextValid(sc) ? ctx : undefined;
}

/**
 * Marks the active span as working on `op` (its ids, kind and, under a claim, the fence), and links it
 * to the trace its confirmation began when it is not already part of it.
 */
export function traceOperation(op: { id: string; order_id: string | null; kind: string; traceparent?: string | null }, fence?: number): void {
  const span = trace.getActiveSpan();
  if (!span?.isRecording()) return;
  span.setAttributes({ [ATTR.operationId]: op.id, ...(op.order_id ? { [ATTR.orderId]: op.order_id } : {}), [ATTR.kind]: op.kind });
  if (fence !== undefined) span.setAttribute(ATTR.fence, fence);
  const origin = trace.getSpanContext(contextOf(op.traceparent) ?? ROOT_CONTEXT);
  if (origin && origin.traceId !== span.spanContext().traceId) span.addLink({ context: origin, attributes: { 'outboxd.link': 'confirmation' } });
}

/** One span per settlement event handed to an application's onSettled handler (each retry its own),
 * linked to the payment's trace. */
export function traceDelivery<T>(
  event: { operationId: string; orderId: string | null; kind: string; status: string; source: string; traceparent?: string | null },
  retry: number,
  fn: () => Promise<T>,
): Promise<T> {
  const attributes = { [ATTR.status]: event.status, 'outboxd.source': event.source, 'outboxd.delivery_retry': retry };
  return withSpan('outboxd.settlement_delivery', attributes, async () => {
    traceOperation({ id: event.operationId, order_id: event.orderId, kind: event.kind, traceparent: event.traceparent });
    return fn();
  }, { kind: SpanKind.CONSUMER });
}

/**
 * One span per charge job. A relayed job's first delivery continues the payment's trace (the relay
 * stored the context in the job); anything else (a retry, a requeued or rescheduled job) stays in the
 * trace pg-boss delivered it in, its `process` span, and links to the payment's (traceOperation).
 */
export function traceDispatch<T>(job: { retryCount: number; data?: { operationId?: unknown; traceparent?: unknown } }, fn: () => Promise<T>): Promise<T> {
  const payment = job.retryCount === 0 ? contextOf(job.data?.traceparent) : undefined;
  const delivery = trace.getSpanContext(context.active());
  const attributes = typeof job.data?.operationId === 'string' ? { [ATTR.operationId]: job.data.operationId } : {};
  if (!payment) return withSpan('outboxd.dispatch', attributes, fn);
  // pg-boss's own `process` span stays reachable from the payment's trace.
  const links = delivery && isSpanContextValid(delivery) ? [{ context: delivery, attributes: { 'outboxd.link': 'delivery' } }] : [];
  return withSpan('outboxd.dispatch', attributes, fn, { parent: payment, links });
}

/**
 * The outbox relay: one span per operation, in that operation's trace (a batch spans many payments),
 * and the traceparent of each, for its job. Rows stored without a trace context get neither.
 */
export async function traceRelay<T>(
  rows: { operation_id: string; traceparent?: string | null }[],
  fn: (traceparents: (string | undefined)[]) => Promise<T>,
): Promise<T> {
  const spans = rows.map((row) => {
    const parent = contextOf(row.traceparent);
    return parent && tracer.startSpan('outboxd.relay', { kind: SpanKind.PRODUCER, attributes: { [ATTR.operationId]: row.operation_id, 'messaging.batch.message_count': rows.length } }, parent);
  });
  const traceparents = spans.map((span) => {
    if (!span) return undefined;
    const carrier: Record<string, string> = {};
    traceContextPropagator.inject(trace.setSpan(ROOT_CONTEXT, span), carrier, defaultTextMapSetter);
    return carrier.traceparent;
  });
  try {
    return await fn(traceparents);
  } catch (err) {
    for (const span of spans) if (span) markFailed(span, err);
    throw err;
  } finally {
    for (const span of spans) span?.end();
  }
}

/**
 * Runs `fn` with tracing suppressed, so pg-boss stores no trace context on the jobs it creates: a batch
 * would get one context for many payments, and a rescheduled job would make its next attempt a child
 * of this one instead of a trace that links to the payment's.
 */
export function untraced<T>(fn: () => Promise<T>): Promise<T> {
  return context.with(context.active().setValue(SUPPRESS_TRACING, true), fn);
}

/** trace_id and span_id of the active span, for log lines (pino's mixin); nothing when none is traced. */
export function traceLogFields(): { trace_id?: string; span_id?: string } {
  const sc = trace.getActiveSpan()?.spanContext();
  return sc && isSpanContextValid(sc) ? { trace_id: sc.traceId, span_id: sc.spanId } : {};
}
