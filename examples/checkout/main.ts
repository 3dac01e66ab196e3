// node examples/checkout/main.ts — with DATABASE_URL (and `outboxd worker` running beside it).
import { createCheckout } from './checkout.ts';

const databaseUrl = process.env.DATABASE_URL;
if (!databaseUrl) throw new Error('DATABASE_URL is required');
const checkout = createCheckout(databaseUrl);
const port = await checkout.start(Number(process.env.PORT ?? 3000));
console.log(`checkout listening on http://127.0.0.1:${port}`);
for (const signal of ['SIGINT', 'SIGTERM'] as const) process.once(signal, () => void checkout.stop());
