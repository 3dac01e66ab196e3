// The peer of npm run bench (issue 14): the worker a user would write instead of outboxd. pg-boss takes
// the jobs, the stripe SDK creates one PaymentIntent per job under an idempotency key derived from the
// job, and nothing else: no operation row, no lease, no fence, no outbox, no timeline. Run as its own OS
// process (`node harness/peer.ts`, with the replicas' NODE_OPTIONS) against the bench's database and
// emulator; startPeer() spawns it.
//
// pg-boss at its best measured here: NOTIFY, and loops that wake themselves after each batch, so while
// a backlog lasts no loop waits out a polling interval. PEER_SLOTS calls in flight at most, as
// PEER_SLOTS / PEER_BATCH loops of PEER_BATCH jobs each.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { PgBoss, type Job } from 'pg-boss';
import Stripe from 'stripe';

export const PEER_QUEUE = 'bench_peer';

/** A job of the peer's queue: what its PaymentIntent is created with. */
export interface PeerJob {
  amount: number;
  currency: string;
  customer: string;
  payment_method: string;
  metadata: Record<string, string>;
}

export interface Peer {
  proc: ReturnType<typeof spawn>;
  exited: Promise<number | null>;
  kill(signal: NodeJS.Signals): void;
}

/** Starts the peer as an OS process (node's own flags: `nodeArgs`); resolves once its loops are registered. */
export async function startPeer(env: Record<string, string>, nodeArgs: readonly string[] = []): Promise<Peer> {
  const proc = spawn(process.execPath, [...nodeArgs, fileURLToPath(import.meta.url)], { env: { ...process.env, ...env }, stdio: ['ignore', 'ignore', 'pipe'] });
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve(code)));
  const lines: string[] = [];
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`the peer did not start: ${lines.slice(-5).join('\n')}`)), 30_000);
    createInterface({ input: proc.stderr! }).on('line', (line) => {
      lines.push(line);
      if (line === 'peer ready') {
        clearTimeout(timer);
        resolve();
      }
    });
    void exited.then((code) => reject(new Error(`the peer exited with ${code}: ${lines.slice(-5).join('\n')}`)));
  });
  return { proc, exited, kill: (signal) => proc.kill(signal) };
}

/**
 * The calls alone: PEER_SLOTS loops of the same create, no queue and no database, for `seconds` (after
 * one of warm-up), as an OS process of their own with `nodeArgs`. Calls per second: what the emulator,
 * HTTP and the SDK on this machine allow any worker with that many slots, the ceiling of the
 * latency-bound rates.
 */
export async function callsOnly(env: Record<string, string>, nodeArgs: readonly string[], seconds: number): Promise<number> {
  const proc = spawn(process.execPath, [...nodeArgs, fileURLToPath(import.meta.url)], { env: { ...process.env, ...env, PEER_CALLS_ONLY_SECONDS: String(seconds) }, stdio: ['ignore', 'ignore', 'pipe'] });
  let out = '';
  proc.stderr!.on('data', (d) => (out += d));
  const [code] = (await once(proc, 'exit')) as [number | null];
  const rate = /^calls per second (\S+)$/m.exec(out)?.[1];
  if (code !== 0 || rate === undefined) throw new Error(`the calls-only peer exited with ${code}: ${out.slice(-500)}`);
  return Number(rate);
}

async function callsOnlyLoops(stripe: Stripe, slots: number, seconds: number): Promise<void> {
  let calls = 0;
  const from = performance.now() + 1_000;
  const to = from + seconds * 1_000;
  await Promise.all(Array.from({ length: slots }, async (_, slot) => {
    for (let i = 0; performance.now() < to; i++) {
      await stripe.paymentIntents.create(
        { amount: 1000, currency: 'eur', customer: 'cus_bench', payment_method: 'pm_card_visa', confirm: true, off_session: true, metadata: { order_id: `calls-only-${slot}-${i}` } },
        { idempotencyKey: `peer-calls-only:${process.pid}:${slot}:${i}` },
      );
      const now = performance.now();
      if (now >= from && now < to) calls++;
    }
  }));
  process.stderr.write(`calls per second ${calls / seconds}\n`);
}

async function main() {
  const env = process.env;
  const slots = Number(env.PEER_SLOTS ?? 8);
  const batchSize = Number(env.PEER_BATCH ?? 1);
  const api = new URL(env.STRIPE_API_BASE!);
  const stripe = new Stripe(env.STRIPE_SECRET_KEY!, { host: api.hostname, port: Number(api.port), protocol: 'http' });
  if (env.PEER_CALLS_ONLY_SECONDS) return callsOnlyLoops(stripe, slots, Number(env.PEER_CALLS_ONLY_SECONDS));
  const boss = new PgBoss({ connectionString: env.DATABASE_URL!, useListenNotify: true, application_name: 'bench-peer' });
  boss.on('error', (err) => process.stderr.write(`pg-boss: ${err.message}\n`));
  await boss.start();
  const charge = (job: Job<PeerJob>) => stripe.paymentIntents.create({ ...job.data, confirm: true, off_session: true }, { idempotencyKey: `peer-job:${job.id}` });
  for (let i = 0; i < slots / batchSize; i++) {
    let loop: string | undefined;
    loop = await boss.work<PeerJob>(PEER_QUEUE, { batchSize }, async (jobs) => {
      await Promise.all(jobs.map(charge));
      if (loop) boss.notifyWorker(loop);
    });
  }
  process.once('SIGTERM', () => void boss.stop({ graceful: true, timeout: 5_000 }).then(() => process.exit(0)));
  process.stderr.write('peer ready\n');
}

if (process.argv[1] === fileURLToPath(import.meta.url)) await main();
