// The OpenTelemetry SDK of an `outboxd` process (the worker and the CLI), started only when
// OTEL_EXPORTER_OTLP_ENDPOINT is set and imported only then. The library never starts one: an application
// embedding outboxd registers its own, and outboxd's spans (src/telemetry/tracing.ts, API only) go to it.
//
// Built from the parts rather than @opentelemetry/sdk-node: sdk-node brings metrics, logs, gRPC and
// instrumentation we do not use, and reads its settings from the environment itself, where outboxd reads
// them once in src/runtime/config.ts. The exporters still read their own tuning variables (OTEL_EXPORTER_OTLP_HEADERS,
// _TIMEOUT, _COMPRESSION, _CERTIFICATE), which nothing here needs to know.
import { context, diag, DiagLogLevel, propagation, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { CompositePropagator, W3CBaggagePropagator, W3CTraceContextPropagator } from '@opentelemetry/core';
import { OTLPTraceExporter as JsonExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { OTLPTraceExporter as ProtobufExporter } from '@opentelemetry/exporter-trace-otlp-proto';
import { resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOffSampler,
  AlwaysOnSampler,
  BatchSpanProcessor,
  ParentBasedSampler,
  TraceIdRatioBasedSampler,
  TracerProvider,
  type Sampler,
} from '@opentelemetry/sdk-trace';
import type { TracingConfig } from '../runtime/config.ts';
import type { Logger } from './log.ts';

export interface Tracing {
  /** Exports what is still buffered and stops, within a few seconds: false when the collector did not
   * answer in time (its request may then hold the process until the exporter's own timeout). */
  shutdown(): Promise<boolean>;
}

const SHUTDOWN_TIMEOUT_MS = 5_000;

export function startTracing(config: TracingConfig, opts: { serviceVersion: string; log: Logger }): Tracing {
  // The SDK's own troubles (an export refused, a collector away) in our logs, not on the console.
  const warn = (message: string, ...args: unknown[]) => opts.log.warn({ otel: message, detail: args.map(String) }, 'opentelemetry');
  diag.setLogger({ error: warn, warn, info: () => {}, debug: () => {}, verbose: () => {} }, DiagLogLevel.WARN);
  const exporter = config.protocol === 'http/json' ? new JsonExporter({ url: config.url }) : new ProtobufExporter({ url: config.url });
  const provider = new TracerProvider({
    resource: resourceFromAttributes({ 'service.name': config.serviceName, 'service.version': opts.serviceVersion }),
    sampler: samplerOf(config),
    spanProcessors: [new BatchSpanProcessor({ exporter })],
  });
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  propagation.setGlobalPropagator(new CompositePropagator({ propagators: [new W3CTraceContextPropagator(), new W3CBaggagePropagator()] }));
  trace.setGlobalTracerProvider(provider);
  opts.log.debug({ url: config.url, protocol: config.protocol, sampler: config.sampler }, 'tracing on');
  return {
    shutdown: async () => {
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<false>((resolve) => (timer = setTimeout(() => resolve(false), SHUTDOWN_TIMEOUT_MS)));
      const answered = provider.shutdown().then(
        () => true,
        (err: Error) => {
          opts.log.warn({ err }, 'tracing shutdown failed');
          return true;
        },
      );
      const inTime = await Promise.race([answered, late]);
      clearTimeout(timer);
      if (!inTime) opts.log.warn({ url: config.url }, `spans not exported within ${SHUTDOWN_TIMEOUT_MS} ms: exiting without them`);
      return inTime;
    },
  };
}

/** OTEL_TRACES_SAMPLER as the specification names them. */
function samplerOf(config: TracingConfig): Sampler {
  const ratio = new TraceIdRatioBasedSampler(config.samplerRatio);
  switch (config.sampler) {
    case 'always_on':
      return new AlwaysOnSampler();
    case 'always_off':
      return new AlwaysOffSampler();
    case 'traceidratio':
      return ratio;
    case 'parentbased_always_on':
      return new ParentBasedSampler({ root: new AlwaysOnSampler() });
    case 'parentbased_always_off':
      return new ParentBasedSampler({ root: new AlwaysOffSampler() });
    case 'parentbased_traceidratio':
      return new ParentBasedSampler({ root: ratio });
  }
}
