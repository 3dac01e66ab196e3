// A process that traces nothing never loads @opentelemetry/core (about 2 MB of a replica's RSS): the W3C
// propagator is loaded the first time there is a context to carry, and untraced() marks a context with
// core's own suppression key without it. Checked against core itself: what the lazy propagator writes and
// reads, and that every SDK sees untraced() as suppressed.
import { execFile } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { context, defaultTextMapGetter, defaultTextMapSetter, ROOT_CONTEXT, trace, TraceFlags } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { isTracingSuppressed, W3CTraceContextPropagator } from '@opentelemetry/core';
import { beforeAll, describe, expect, it } from 'vitest';
import { activeTraceparent, contextOf, traceContextPropagator, untraced } from '../../src/telemetry/tracing.ts';

const root = resolve(import.meta.dirname, '../..');

describe('tracing without an SDK', () => {
  it('loads no @opentelemetry/core: not on import of the library or the worker, nor to inject without a span, extract without a traceparent, or run untraced', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'outboxd-lazy-'));
    const hook = join(dir, 'hook.mjs');
    // Every module the process resolves, as the worker's own imports would resolve it.
    writeFileSync(hook, `import { registerHooks } from 'node:module';
globalThis.resolved = [];
registerHooks({ resolve(s, c, next) { const r = next(s, c); globalThis.resolved.push(r.url); return r; } });`);
    const script = `
      import { context, defaultTextMapGetter, defaultTextMapSetter, ROOT_CONTEXT } from '@opentelemetry/api';
      await import(${JSON.stringify(join(root, 'src/index.ts'))});
      await import(${JSON.stringify(join(root, 'src/runtime/worker.ts'))});
      const t = await import(${JSON.stringify(join(root, 'src/telemetry/tracing.ts'))});
      const carrier = {};
      t.traceContextPropagator.inject(context.active(), carrier, defaultTextMapSetter);
      t.traceContextPropagator.extract(ROOT_CONTEXT, {}, defaultTextMapGetter);
      const results = [t.activeTraceparent(), t.contextOf(null), Object.keys(carrier).length, await t.untraced(async () => 'ran')];
      console.log(JSON.stringify({ results, core: globalThis.resolved.filter((u) => u.includes('@opentelemetry/core')) }));`;
    const { stdout } = await promisify(execFile)(process.execPath, ['--experimental-strip-types', '--no-warnings', '--import', hook, '--input-type=module', '-e', script], { cwd: root });
    expect(JSON.parse(stdout)).toEqual({ results: [null, null, 0, 'ran'], core: [] });
  });
});

describe('tracing with a context', () => {
  const core = new W3CTraceContextPropagator();
  const span = trace.wrapSpanContext({ traceId: '4bf92f3577b34da6a3ce929d0e0e4736', spanId: '00f067aa0ba902b7', traceFlags: TraceFlags.SAMPLED });
  const traced = trace.setSpan(ROOT_CONTEXT, span);
  // What an SDK registers: without a context manager no context is ever active.
  beforeAll(() => void context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable()));

  it("injects and extracts what core's W3C propagator does", () => {
    const ours: Record<string, string> = {};
    const theirs: Record<string, string> = {};
    traceContextPropagator.inject(traced, ours, defaultTextMapSetter);
    core.inject(traced, theirs, defaultTextMapSetter);
    expect(ours).toEqual(theirs);
    expect(ours.traceparent).toBe('00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01');
    expect(context.with(traced, activeTraceparent)).toBe(ours.traceparent);
    const extracted = trace.getSpanContext(traceContextPropagator.extract(ROOT_CONTEXT, ours, defaultTextMapGetter));
    expect(extracted).toEqual(trace.getSpanContext(core.extract(ROOT_CONTEXT, theirs, defaultTextMapGetter)));
    expect(trace.getSpanContext(contextOf(ours.traceparent)!)?.traceId).toBe('4bf92f3577b34da6a3ce929d0e0e4736');
  });

  it('untraced() is suppressed as core sees it, so an SDK records nothing inside it', async () => {
    expect(isTracingSuppressed(context.active())).toBe(false);
    expect(await untraced(async () => isTracingSuppressed(context.active()))).toBe(true);
    // A suppressed context carries no trace context into what it writes.
    const carrier: Record<string, string> = {};
    await context.with(traced, () => untraced(async () => traceContextPropagator.inject(context.active(), carrier, defaultTextMapSetter)));
    expect(carrier).toEqual({});
  });
});
