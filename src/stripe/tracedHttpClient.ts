// One CLIENT span per HTTP request the Stripe SDK sends (its own resends included, so a create sent twice
// shows twice), named and described by OpenTelemetry's HTTP client conventions, with Stripe's request id:
// what Stripe support asks for. It sees the request as the SDK hands it to the transport and records
// only the method, the URL without its query and the answer's status and request id: never a header
// (the secret key travels in Authorization) nor a body (the payment method and customer do). It ends
// when the answer's headers arrive: a body cut off after them shows on the executor's gateway span.
import { SpanKind, SpanStatusCode } from '@opentelemetry/api';
import Stripe from 'stripe';
import { withSpan } from '../telemetry/tracing.ts';

/** Stripe's object ids in a path (pi_3Mt…, re_…) become {id}: a span name must not be unique per object.
 * An id has a digit or a capital after its prefix; a resource name (payment_intents) has neither. */
const urlTemplate = (path: string) => path.replace(/\/[a-z]+_(?=[a-z]*[A-Z0-9])[A-Za-z0-9]+(?=\/|$)/g, '/{id}');

export function tracedHttpClient(inner: Stripe.HttpClient = Stripe.createNodeHttpClient()): Stripe.HttpClient {
  return {
    getClientName: () => inner.getClientName(),
    makeRequest: (host, port, path, method, headers, body, protocol, timeout) => {
      const pathOnly = path.split('?')[0]!;
      const template = urlTemplate(pathOnly);
      const attributes = {
        'http.request.method': method,
        'server.address': host,
        'server.port': Number(port),
        'url.full': `${protocol}://${host}:${port}${pathOnly}`,
        'url.template': template,
      };
      return withSpan(`${method} ${template}`, attributes, async (span) => {
        const res = await inner.makeRequest(host, port, path, method, headers, body, protocol, timeout);
        const status = res.getStatusCode();
        const requestId = res.getHeaders()['request-id'];
        span.setAttribute('http.response.status_code', status);
        if (typeof requestId === 'string') span.setAttribute('stripe.request_id', requestId);
        if (status >= 400) {
          span.setAttribute('error.type', String(status));
          span.setStatus({ code: SpanStatusCode.ERROR });
        }
        return res;
      }, { kind: SpanKind.CLIENT });
    },
  };
}
