// A small checkout service built on outboxd, as an application would write it:
//   POST /orders               { email, totalCents, currency, customer, paymentMethod } → 201 { orderId, operationId }
//   POST /orders/:id/payment   { paymentMethod } → 202 { operationId }   (another card after a decline)
//   GET  /orders/:id           → the order, with its payment operation
// Bad input answers 400 { error: 'validation', field, message } naming the field; any other failure a bare 500
// (details in the log, never the SQL or its parameters in the answer).
// The order and its charge request commit in ONE transaction of the checkout's own; the order becomes
// paid (or payment_failed) in ANOTHER: the transaction in which outboxd delivers the settlement to the
// checkout's transactional subscriber and records it consumed, so the order is updated once per event.
import { randomUUID } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { and, eq } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import pg from 'pg';
import { z } from 'zod';
// In your application: import { Outboxd, … } from 'outboxd';
import { OrderConflictError, Outboxd, ValidationError, type SettlementEvent, type SettlementTransaction } from '../../src/index.ts';
import { CREATE_ORDERS, orders } from './schema.ts';

export interface Checkout {
  server: Server;
  /** Listens on `port` (0: any free one) once outboxd's migrations, the orders table and the subscription are in place. */
  start(port: number): Promise<number>;
  stop(): Promise<void>;
}

/** `logError` receives what a 500 does not show (default: console.error). */
export function createCheckout(databaseUrl: string, logError: (message: string, err: unknown) => void = console.error): Checkout {
  const pool = new pg.Pool({ connectionString: databaseUrl });
  const db = drizzle({ client: pool });
  const outboxd = new Outboxd({ pool });

  /** The checkout's subscriber: its writes through `tx` commit with outboxd's record that it consumed the
   * event, or neither does (a throw, a timeout, a crash: the event comes back). An event of an operation
   * the order no longer waits for (a superseded card) changes nothing. */
  async function onSettled(event: SettlementEvent, tx: SettlementTransaction): Promise<void> {
    // Refunds (and any other kind) settle too: an order waits for its charge only.
    if (event.kind !== 'charge' || event.orderId === null) return;
    // drizzle over the delivery's transaction: anything with query(text, values) serves as its client.
    await drizzle({ client: tx as unknown as pg.PoolClient })
      .update(orders)
      .set({ status: event.status === 'succeeded' ? 'paid' : 'payment_failed' })
      .where(and(eq(orders.id, event.orderId), eq(orders.paymentOperationId, event.operationId), eq(orders.status, 'awaiting_payment')));
  }

  async function placeOrder(input: unknown) {
    const { email, totalCents, currency, customer, paymentMethod } = parseBody(placeOrderBody, input);
    const orderId = randomUUID();
    return db.transaction(async (tx) => {
      // outboxd first: it checks the charge's fields (amount, currency, ids) before writing anything, so a
      // bad one is refused by its rules before the checkout's own insert can fail on it.
      const { operationId } = await chargeFor(() =>
        outboxd.requestCharge(tx, { orderId, amount: totalCents, currency, customer, paymentMethod }),
      );
      await tx.insert(orders).values({ id: orderId, email, totalCents, currency, customer, paymentOperationId: operationId });
      return { orderId, operationId };
    });
  }

  /** Another card for an order whose payment failed: outboxd makes a new operation (a new key). */
  async function payAgain(orderId: string, input: unknown) {
    const { paymentMethod } = parseBody(payAgainBody, input);
    return db.transaction(async (tx) => {
      const [order] = await tx.select().from(orders).where(eq(orders.id, orderId)).for('update');
      if (!order) return undefined;
      const { operationId } = await chargeFor(() =>
        outboxd.requestCharge(tx, { orderId, amount: order.totalCents, currency: order.currency, customer: order.customer, paymentMethod }),
      );
      await tx.update(orders).set({ paymentOperationId: operationId, status: 'awaiting_payment' }).where(and(eq(orders.id, orderId), eq(orders.status, 'payment_failed')));
      return { operationId };
    });
  }

  async function route(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const url = new URL(req.url ?? '/', 'http://checkout');
    const [, resource, id, sub] = url.pathname.split('/');
    if (resource !== 'orders') return send(res, 404, { error: 'not_found' });
    if (req.method === 'POST' && !id) return send(res, 201, await placeOrder(await json(req)));
    // Order ids are uuids: anything else names no order (and would only make the uuid column's query fail).
    if (id && !z.uuid().safeParse(id).success) return send(res, 404, { error: 'not_found' });
    if (req.method === 'POST' && id && sub === 'payment') {
      const paid = await payAgain(id, await json(req));
      return paid ? send(res, 202, paid) : send(res, 404, { error: 'not_found' });
    }
    if (req.method === 'GET' && id && !sub) {
      const [order] = await db.select().from(orders).where(eq(orders.id, id));
      if (!order) return send(res, 404, { error: 'not_found' });
      const payment = order.paymentOperationId ? await outboxd.getOperation(order.paymentOperationId) : undefined;
      return send(res, 200, { ...order, payment });
    }
    send(res, 405, { error: 'method_not_allowed' });
  }

  const server = createServer((req, res) => {
    route(req, res).catch((err: unknown) => {
      // outboxd refuses bad input and conflicting requests with typed errors, before writing anything.
      if (err instanceof ValidationError) return send(res, 400, { error: 'validation', field: err.field, message: err.message });
      if (err instanceof OrderConflictError) return send(res, 409, { error: 'conflict', field: err.field, message: err.message });
      // A database error's message carries the failing statement and its parameters (drizzle's
      // "Failed query: … params: …"): it goes to the log, never to the client.
      logError('checkout: request failed', err);
      send(res, 500, { error: 'internal' });
    });
  });

  return {
    server,
    async start(port) {
      await outboxd.migrate();
      await db.execute(CREATE_ORDERS);
      await outboxd.onSettled(onSettled, { transactional: true, subscriber: 'checkout-orders' });
      await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
      return (server.address() as { port: number }).port;
    },
    async stop() {
      await new Promise((resolve) => server.close(resolve));
      await outboxd.stop();
      await pool.end();
    },
  };
}

/** The JSON shapes the checkout takes. Only types and its own field (email) are checked here: the charge's
 * rules (a positive integer amount, a currency Stripe accepts, ids without control characters, their
 * lengths) are outboxd's, applied by requestCharge before it writes. */
const placeOrderBody = z.object({
  email: z.email('email must be an email address').max(254, 'email must be at most 254 characters'),
  totalCents: z.number('totalCents must be a number'),
  currency: z.string('currency must be a string'),
  customer: z.string('customer must be a string'),
  paymentMethod: z.string('paymentMethod must be a string'),
});
const payAgainBody = z.object({ paymentMethod: z.string('paymentMethod must be a string') });

/** outboxd's field names, as the checkout's body names them. */
const BODY_FIELD: Record<string, string> = { amount: 'totalCents' };

function parseBody<T>(schema: z.ZodType<T>, input: unknown): T {
  const parsed = schema.safeParse(input);
  if (parsed.success) return parsed.data;
  const issue = parsed.error.issues[0]!;
  throw new ValidationError(issue.path.map(String).join('.') || 'body', issue.message);
}

/** A charge request whose ValidationError is renamed to the checkout's field. */
async function chargeFor<T>(request: () => Promise<T>): Promise<T> {
  try {
    return await request();
  } catch (err) {
    if (err instanceof ValidationError && BODY_FIELD[err.field]) throw new ValidationError(BODY_FIELD[err.field]!, err.detail);
    throw err;
  }
}

async function json(req: IncomingMessage): Promise<unknown> {
  let body = '';
  for await (const chunk of req) body += chunk;
  if (!body) return {};
  try {
    return JSON.parse(body);
  } catch {
    throw new ValidationError('body', 'must be JSON');
  }
}

function send(res: ServerResponse, status: number, body: unknown): void {
  res.writeHead(status, { 'Content-Type': 'application/json' });
  res.end(JSON.stringify(body));
}
