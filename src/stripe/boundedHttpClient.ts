// The SDK's `timeout` as a deadline for a whole request, headers and body. Stripe's Node client gives it to
// the socket as an idle timeout, so an answer that keeps trickling (a byte every few seconds: a proxy or a
// network gone wrong) never times out, and its call would hold a replica's slot, and renew its lease, for
// as long as the trickle lasts. Past the deadline the request fails as a timeout (StripeConnectionError,
// so ambiguous: resent with the same key). The body is cut off there (its socket destroyed); headers that
// never finish cannot be (the Node client keeps its request to itself): their request is left to end by
// itself, owned by nothing, and its response dropped when it comes.
import type { IncomingMessage } from 'node:http';
import Stripe from 'stripe';
import { withinDeadline } from '../types/deadline.ts';

export function boundedHttpClient(inner: Stripe.HttpClient = Stripe.createNodeHttpClient()): Stripe.HttpClient {
  return {
    getClientName: () => inner.getClientName(),
    makeRequest: async (host, port, path, method, headers, body, protocol, timeout) => {
      const deadline = performance.now() + timeout;
      const pending = inner.makeRequest(host, port, path, method, headers, body, protocol, timeout);
      const res = await withinDeadline(pending, timeout, () => {
        pending.then((r) => raw(r)?.destroy(), () => {});
        return Stripe.HttpClient.makeTimeoutError();
      });
      const stream = raw(res);
      if (!stream) return res;
      // What is left of the deadline for the body: the client's own toJSON fails once its stream is destroyed.
      const cut = setTimeout(() => stream.destroy(Stripe.HttpClient.makeTimeoutError()), Math.max(0, deadline - performance.now()));
      stream.once('close', () => clearTimeout(cut));
      return res;
    },
  };
}

/** The Node client's response stream (undefined for another client's). */
const raw = (res: Stripe.HttpClientResponse): IncomingMessage | undefined => {
  const stream = res.getRawResponse() as IncomingMessage | undefined;
  return typeof stream?.destroy === 'function' && typeof stream.once === 'function' ? stream : undefined;
};
