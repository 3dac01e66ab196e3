// `outboxd`: a thin command line over the capabilities. Config is parsed once here; every command
// prints its result on stdout (JSON with --json) and its errors on stderr with a non-zero exit.
import { readFileSync } from 'node:fs';
import { Command, CommanderError, InvalidArgumentError, Option } from 'commander';
import { loadConfig, type Config } from '../runtime/config.ts';
import { migrate } from '../db/migrate.ts';
import { createLogger, type Logger } from '../telemetry/log.ts';
import { BULK_CONCURRENCY, confirmFromFile, type BulkSummary } from '../exampleApp/bulk.ts';
import { confirmOrder } from '../exampleApp/confirm.ts';
import { EXAMPLE_SUBSCRIBER, followOrders } from '../exampleApp/follow.ts';
import { Outboxd } from '../outboxd.ts';
import { parseOrderInput } from '../kinds/charge/input.ts';
import { CANCELLATION_REASONS, REFUND_REASONS } from '../stripe/gateway.ts';
import { requestRefund } from '../kinds/refund/request.ts';
import { requestCancel, requestCapture } from '../kinds/hold/request.ts';
import { inTransaction, type Tx } from '../db/pool.ts';
import { createBoss, onBossWarnings, startBoss } from '../outbox/outbox.ts';
import type { PgBoss } from 'pg-boss';
import { openDatabase, openGateway, openPool, serveEmulator, type Database } from '../runtime/open.ts';
import { acknowledgeOperation } from '../admin/acknowledge.ts';
import { findOperation, listOperations, operationReference, showOperation } from '../admin/operations.ts';
import { listAudit } from '../admin/audit.ts';
import { loadEffects, runWorker } from '../runtime/worker.ts';
import { userInfo } from 'node:os';
import { requeueOperation, requeueStuck } from '../admin/requeue.ts';
import { resolveOperation, type Resolution } from '../admin/resolve.ts';
import { driftReport } from '../reconcile/drift.ts';
import { reconcileNow } from '../admin/reconcile.ts';
import { redriveSettlements } from '../outbox/settlements.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import type { Tracing } from '../telemetry/tracingSdk.ts';
import { parseDuration } from './duration.ts';
import { errorMessage, EXIT, exitCodeOf, flagOf } from './exit.ts';
import { printAudit, printOperations, ranges } from './print.ts';

const { version } = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8'));

// Commander prints its own parse errors; an error it did not print (one thrown by an action) is
// printed at the end instead, so that no usage error exits silently.
let commanderPrinted = false;
const program = new Command('outboxd')
  .description('Effectively-once payment side effects from a PostgreSQL outbox')
  .version(version)
  .configureOutput({
    outputError: (text, write) => {
      commanderPrinted = true;
      write(text);
    },
  })
  .showHelpAfterError()
  .exitOverride();

let config: Config;
let log: Logger | undefined;
let tracing: Tracing | undefined;
/** Set once `worker` has drained and closed what it opened: the process exits then, whatever still runs. */
let workerStopped = false;
/** The command being run (`migrate`, `list`, …) and its schema, for the words of its error. */
const errorContext: { command?: string; schema?: string } = {};
program.hook('preAction', async (_program, command) => {
  errorContext.command = command.name();
  config = loadConfig();
  errorContext.schema = config.schema;
  log = createLogger(config.logLevel, { cmd: 'outboxd' });
  // Only with an endpoint: otherwise the SDK is not even loaded, and every span is the API's no-op.
  if (config.tracing) tracing = (await import('../telemetry/tracingSdk.ts')).startTracing(config.tracing, { serviceVersion: version, log });
});

/** Runs `fn` with an open database and pool, closing both however it ends. */
async function withDatabase<T>(fn: (ctx: { url: string; pool: ReturnType<typeof openPool>; db: Database }) => Promise<T>): Promise<T> {
  const db = await openDatabase(config, log!);
  const pool = openPool(db, 'outboxd-cli', BULK_CONCURRENCY);
  try {
    return await fn({ url: db.url, pool, db });
  } finally {
    await pool.end();
    await db.close();
  }
}

/** Runs `fn` with a pg-boss that only sends and reads jobs (no supervision), then stops it. */
async function withBoss<T>(url: string, fn: (boss: PgBoss) => Promise<T>): Promise<T> {
  const boss = createBoss(url, 'client', 2, config.schema);
  boss.on('error', (err) => log!.warn({ err }, 'pg-boss error'));
  onBossWarnings(boss, (message, data) => log!.warn({ bossWarning: data }, message));
  await startBoss(boss, config.schema);
  try {
    return await fn(boss);
  } finally {
    await boss.stop({ graceful: false });
  }
}

/** Runs `fn` with Stripe's answers as evidence (never an emulator that knows nothing), then closes the gateway. */
async function withGateway<T>(db: Database, fn: (gateway: PaymentGateway) => Promise<T>): Promise<T> {
  const handle = await openGateway(config, log!, db, { evidence: true });
  try {
    return await fn(handle.gateway);
  } finally {
    await handle.close();
  }
}

/** An amount: its sign is the request's to judge, which names the field as the library does. */
const integer = (v: string) => {
  const n = Number(v);
  if (!Number.isSafeInteger(n)) throw new InvalidArgumentError('must be an integer');
  return n;
};
const positiveInt = (v: string) => {
  const n = integer(v);
  if (n < 1) throw new InvalidArgumentError('must be an integer ≥ 1');
  return n;
};
const nonNegativeInt = (v: string) => {
  if (!/^\d+$/.test(v) || !Number.isSafeInteger(Number(v))) throw new InvalidArgumentError('must be an integer ≥ 0');
  return Number(v);
};
const positiveRate = (v: string) => {
  const n = Number(v);
  if (!(n > 0) || !Number.isFinite(n)) throw new InvalidArgumentError('must be a number of requests per second > 0');
  return n;
};
/** An operation's id or short id, checked before the command opens anything (a database, an emulator);
 * an error names the argument as `field`. */
const operationRefAs = (field: 'operationId' | 'chargeOperationId') => (v: string) => {
  operationReference(v, field);
  return v;
};
const operationRef = operationRefAs('operationId');
const chargeOperationRef = operationRefAs('chargeOperationId');
const port = (v: string) => {
  if (!/^\d+$/.test(v) || Number(v) > 65_535) throw new InvalidArgumentError('must be a port number from 0 to 65535 (0: any free port)');
  return Number(v);
};

program
  .command('migrate')
  .description('apply the drizzle/ migrations and the pg-boss schema (idempotent)')
  .action(async () => {
    // The migrations' lock is a session's: behind a transaction pooler, on the direct connection.
    if (config.databaseUrl) await migrate(config.databaseDirectUrl ?? config.databaseUrl, config.schema);
    else await withDatabase(async () => {}); // opening the embedded database migrates it
    log!.info('migrations applied');
  });

program
  .command('worker')
  .description('one dispatcher replica, until SIGTERM/SIGINT')
  .option('--effects <module>', "the application's kinds of effect: a module whose default export maps each kind to { policy, execute, check? }")
  .action(async (o) => {
    await runWorker(config, log!, o.effects ? await loadEffects(o.effects) : undefined);
    workerStopped = true;
  });

const order = program.command('order').description('orders');
const ORDER_FIELDS = ['orderId', 'amount', 'currency', 'customer', 'paymentMethod'];
order
  .command('confirm')
  .description('confirm an order: order, charge operation and outbox row in one transaction')
  .option('--order-id <id>')
  .addOption(new Option('--amount <minor-units>', 'amount in minor units').argParser(integer))
  .option('--currency <code>', 'ISO 4217 currency, e.g. eur')
  .option('--customer <cus>')
  .option('--payment-method <pm>')
  .addOption(new Option('--capture <method>', 'manual: an authorization, captured later with `outboxd capture` (or released with `outboxd cancel`)').choices(['automatic', 'manual']))
  .option('--stripe-account <acct>', 'Connect: the connected account the charge is made on')
  .option('--transfer-destination <acct>', 'Connect: a destination charge, its funds transferred to this connected account')
  .addOption(new Option('--application-fee <minor-units>', "Connect: the platform's fee").argParser(nonNegativeInt))
  .addOption(
    new Option('--from-file <orders.jsonl>', 'one order a line: {"orderId","amount","currency","customer","paymentMethod"}')
      .conflicts(ORDER_FIELDS),
  )
  .option('--json', 'machine-readable output')
  .action(async (o) => {
    if (o.fromFile) return withDatabase(({ pool }) => confirmBulk(pool, o.fromFile, !!o.json));
    const missing = ORDER_FIELDS.filter((f) => o[f] === undefined);
    if (missing.length > 0) throw new InvalidArgumentError(`missing ${missing.map(flagOf).join(', ')} (or --from-file)`);
    // Refused before the database is opened; the fields come back named as their flags.
    const input = parseOrderInput({
      ...Object.fromEntries(ORDER_FIELDS.map((f) => [f, o[f]])),
      ...(o.capture ? { captureMethod: o.capture } : {}),
      ...(o.stripeAccount !== undefined ? { stripeAccount: o.stripeAccount } : {}),
      ...(o.transferDestination !== undefined ? { transferData: { destination: o.transferDestination } } : {}),
      ...(o.applicationFee !== undefined ? { applicationFeeAmount: o.applicationFee } : {}),
    });
    await withDatabase(async ({ pool }) => {
      const { operationId, created } = await confirmOrder(pool, input);
      console.log(o.json ? JSON.stringify({ operationId, created }) : operationId);
      if (!created && !o.json) {
        const op = await showOperation(pool, operationId);
        console.error(`order ${input.orderId} was already confirmed: operation ${operationId} (status ${op.status})`);
      }
    });
  });

order
  .command('follow')
  .description("the example's settlement subscriber: marks its orders paid or payment_failed, once per settlement (a transactional onSettled), until SIGTERM/SIGINT")
  .action(async () => {
    await withDatabase(async ({ url, db }) => {
      // Behind a transaction pooler, the subscription LISTENs and takes migrate's lock on the database itself.
      const outboxd = new Outboxd({ connectionString: url, directConnectionString: db.directUrl, schema: config.schema, onError: (err) => log!.warn({ err }, 'settlement subscription error') });
      try {
        await followOrders(outboxd);
        log!.info({ subscriber: EXAMPLE_SUBSCRIBER }, 'following settlements');
        await new Promise<void>((resolve) => {
          process.once('SIGINT', resolve);
          process.once('SIGTERM', resolve);
        });
      } finally {
        await outboxd.stop();
      }
    });
  });

program
  .command('refund')
  .description('refund a succeeded charge: a refund operation and its outbox row in one transaction')
  .argument('<charge-op-id>', 'the charge operation: its id, or its short id (a unique prefix of 8 or more hex digits)', chargeOperationRef)
  .addOption(new Option('--amount <minor-units>', 'amount in minor units').argParser(integer).makeOptionMandatory())
  .addOption(new Option('--key <key>', 'your name for this refund: the same key of the same charge is the same refund').makeOptionMandatory())
  .addOption(new Option('--reason <reason>').choices(REFUND_REASONS))
  .option('--reverse-transfer', "a destination charge's refund: take the transfer back from the connected account")
  .option('--refund-application-fee', "a destination charge's refund: give the platform's fee back")
  .option('--json', 'machine-readable output')
  .action((id: string, o) =>
    requestOfCharge(id, o, 'refund', (tx, chargeOperationId) =>
      requestRefund(tx, {
        chargeOperationId,
        amount: o.amount,
        key: o.key,
        ...(o.reason ? { reason: o.reason } : {}),
        ...(o.reverseTransfer ? { reverseTransfer: true } : {}),
        ...(o.refundApplicationFee ? { refundApplicationFee: true } : {}),
      }),
    ),
  );

program
  .command('capture')
  .description("capture an authorization (a charge confirmed with --capture manual): a capture operation and its outbox row in one transaction")
  .argument('<charge-op-id>', 'the charge operation: its id, or its short id (a unique prefix of 8 or more hex digits)', chargeOperationRef)
  .addOption(new Option('--key <key>', 'your name for this capture: the same key of the same charge is the same capture').makeOptionMandatory())
  .addOption(new Option('--amount <minor-units>', 'at most what it holds; default: all of it (the rest is released)').argParser(integer))
  .option('--json', 'machine-readable output')
  .action((id: string, o) =>
    requestOfCharge(id, o, 'capture', (tx, chargeOperationId) =>
      requestCapture(tx, { chargeOperationId, key: o.key, ...(o.amount !== undefined ? { amount: o.amount } : {}) }),
    ),
  );

program
  .command('cancel')
  .description('cancel an authorization, releasing what it holds: a cancel operation and its outbox row in one transaction')
  .argument('<charge-op-id>', 'the charge operation: its id, or its short id (a unique prefix of 8 or more hex digits)', chargeOperationRef)
  .addOption(new Option('--key <key>', 'your name for this cancel: the same key of the same charge is the same cancel').makeOptionMandatory())
  .addOption(new Option('--reason <reason>').choices(CANCELLATION_REASONS))
  .option('--json', 'machine-readable output')
  .action((id: string, o) =>
    requestOfCharge(id, o, 'cancel', (tx, chargeOperationId) => requestCancel(tx, { chargeOperationId, key: o.key, ...(o.reason ? { reason: o.reason } : {}) })),
  );

/** A refund, capture or cancel of a charge (by id or unique prefix) requested in one transaction; prints
 * its operation id (JSON: with whether it was created), and says so when the key was asked before. */
async function requestOfCharge(
  id: string,
  o: { key: string; json?: boolean },
  what: string,
  request: (tx: Tx, chargeOperationId: string) => Promise<{ operationId: string; created: boolean }>,
): Promise<void> {
  await withDatabase(async ({ pool }) => {
    const charge = await findOperation(pool, id);
    const { operationId, created } = await inTransaction(pool, (tx) => request(tx, charge.id));
    console.log(o.json ? JSON.stringify({ operationId, created }) : operationId);
    if (!created && !o.json) console.error(`key ${o.key} of charge ${charge.id} was already requested: ${what} operation ${operationId}`);
  });
}

const ops = program.command('ops').description('payment operations');
ops
  .command('list')
  .description('list operations (oldest first, or newest with --newest)')
  .addOption(new Option('--status <status>').choices(['pending', 'unknown', 'succeeded', 'failed']))
  .option('--needs-review', 'only operations held for a person, with the reason')
  .option('--newest', 'the newest first: with --limit, the last n requested')
  .addOption(new Option('--limit <n>').argParser(positiveInt).default(1000))
  .option('--json', 'machine-readable output')
  .action(async (o) => {
    await withDatabase(async ({ pool }) => {
      const rows = await listOperations(pool, { status: o.status, needsReview: !!o.needsReview, limit: o.limit, newestFirst: !!o.newest });
      printOperations(rows, o.json);
    });
  });
ops
  .command('show')
  .description('one operation, as JSON')
  .argument('<op-id>', 'its id, or its short id (a unique prefix of 8 or more hex digits)', operationRef)
  .option('--json', 'machine-readable output (the default for show)')
  .action(async (id: string) => {
    await withDatabase(async ({ pool }) => {
      console.log(JSON.stringify(await findOperation(pool, id), null, 2));
    });
  });

program
  .command('stripe-emulator')
  .description('the built-in Stripe emulator, standalone (control API under /_emulator/, see docs/emulator.md)')
  .addOption(new Option('--port <n>').argParser(port).default(12111))
  .addOption(new Option('--host <addr>').default('127.0.0.1'))
  .addOption(new Option('--search-lag-ms <ms>').argParser(nonNegativeInt))
  .addOption(new Option('--processing-settle-ms <ms>', 'pm_card_processing succeeds after this').argParser(nonNegativeInt))
  .addOption(new Option('--rate-limit <n>', "the account's requests/s; beyond it, 429 rate_limit").argParser(positiveRate))
  .action(async (o) => {
    // On the embedded default it serves the data directory's ledger, like every other process there.
    const db = config.databaseUrl || config.production ? undefined : await openDatabase(config, log!);
    try {
      const emulator = await serveEmulator(db, { port: o.port, host: o.host, searchLagMs: o.searchLagMs, processingSettleMs: o.processingSettleMs, rateLimit: o.rateLimit });
      log!.warn({ url: emulator.url, ledger: db ? `embedded database under ${config.dataDir}` : 'this process only' }, 'Stripe emulator listening: test keys only (sk_test_…), no real money moves');
      console.log(emulator.url);
      await new Promise<void>((resolve) => {
        process.once('SIGINT', resolve);
        process.once('SIGTERM', resolve);
      });
      await emulator.close();
    } finally {
      await db?.close();
    }
  });

ops
  .command('resolve')
  .description('settle an operation held for review, after checking Stripe (verified again, audited)')
  .argument('<op-id>', 'its id, or its short id (a unique prefix of 8 or more hex digits)', operationRef)
  .option('--succeeded', 'the effect happened: name it with --external-id')
  .addOption(new Option('--external-id <id>', 'what settles it: the PaymentIntent (pi_…) of a charge, the Refund (re_…, pyr_… for a bank debit) of a refund, your reference for an effect of your own').conflicts('failed'))
  .option('--failed', 'the effect did not happen: say why with --reason')
  .addOption(new Option('--reason <text>').conflicts('succeeded'))
  .option('--actor <name>', 'who resolves (audit trail)', defaultActor())
  .option('--json', 'machine-readable output')
  .action(async (id: string, o) => {
    if (!!o.succeeded === !!o.failed) throw new InvalidArgumentError('give exactly one of --succeeded or --failed');
    const resolution: Resolution = o.succeeded
      ? { outcome: 'succeeded', externalId: required(o.externalId, '--succeeded needs --external-id: the PaymentIntent (pi_…) of a charge, the Refund (re_…, pyr_… for a bank debit) of a refund, your reference for an effect of your own') }
      : { outcome: 'failed', reason: required(o.reason, '--failed needs --reason "…"') };
    await withDatabase(async ({ pool, db }) => {
      // The console's short id as `ops show` takes it: one operation, or refused as ambiguous, before Stripe is opened.
      const { id: operationId } = await findOperation(pool, id);
      await withGateway(db, async (gateway) => {
        const opts = { leaseTtlMs: config.worker.leaseTtlMs, searchFreshnessSeconds: config.searchFreshnessSeconds };
        const op = await resolveOperation(pool, gateway, operationId, resolution, o.actor, opts);
        const held = op.review_reason ? `; still held for review (ops acknowledge, once dealt with in Stripe): ${op.review_reason}` : '';
        console.log(o.json ? JSON.stringify(op) : `${op.id} ${op.status}${held}`);
      });
    });
  });

ops
  .command('acknowledge')
  .description('clear the review reason of a settled operation, once what it reports is dealt with in Stripe (audited; nothing else changes)')
  .argument('<op-id>', 'its id, or its short id (a unique prefix of 8 or more hex digits)', operationRef)
  .requiredOption('--note <text>', 'what was done about it (a second charge refunded, say)')
  .option('--review-reason <text>', 'the review reason as you read it (ops show): refused if it changed since; without it, the reason as it is now')
  .option('--actor <name>', 'who acknowledges (audit trail)', defaultActor())
  .option('--json', 'machine-readable output')
  .action(async (id: string, o) => {
    await withDatabase(async ({ pool }) => {
      const op = await acknowledgeOperation(pool, (await findOperation(pool, id)).id, o.note, o.actor, o.reviewReason);
      console.log(o.json ? JSON.stringify(op) : `${op.id} ${op.status}, no longer held for review; acknowledged: ${op.acknowledgedReason}`);
    });
  });

program
  .command('requeue')
  .description('re-drive unsettled operations with no live job (the same operation, so the same key)')
  .argument('[op-id]', 'its id, or its short id (a unique prefix of 8 or more hex digits)', operationRef)
  .option('--stuck', 'every unsettled operation untouched for --older-than')
  .addOption(new Option('--older-than <duration>', 'e.g. 10m, 2h').argParser(parseDuration).default(600, '10m'))
  .option('--dry-run', 'report what would be requeued')
  .option('--actor <name>', 'who requeues (audit trail)', defaultActor())
  .option('--json', 'machine-readable output')
  .action(async (id: string | undefined, o) => {
    if (!!id === !!o.stuck) {
      throw new InvalidArgumentError(id ? 'give an operation id or --stuck, not both' : 'give an operation id, or --stuck for every stuck one');
    }
    await withDatabase(({ url, pool }) =>
      withBoss(url, async (boss) => {
        const opts = { actor: o.actor, dryRun: !!o.dryRun };
        const results = id
          ? [await requeueOperation(pool, boss, (await findOperation(pool, id)).id, opts)]
          : await requeueStuck(pool, boss, { ...opts, olderThanSeconds: o.olderThan });
        if (o.json) console.log(JSON.stringify(results));
        else for (const r of results) console.log(`${r.operationId} ${r.result}${'reason' in r ? `: ${r.reason}` : ''}`);
        if (results.some((r) => r.result === 'refused')) process.exitCode = EXIT.usage;
      }),
    );
  });

program
  .command('reconcile')
  .description('one reconciliation sweep; with --report, the drift between Stripe and the operations')
  .option('--report', 'report drift instead of settling (exit 5 when drift exists)')
  .option('--actor <name>', 'who runs the sweep (audit trail)', defaultActor())
  .addOption(new Option('--since <duration>', 'report: charges and refunds created since, e.g. 7d').argParser(parseDuration).default(7 * 86400, '7d'))
  .option('--json', 'machine-readable output')
  .action(async (o) => {
    await withDatabase(({ pool, db }) =>
      withGateway(db, async (gateway) => {
        if (o.report) {
          const report = await driftReport(pool, gateway, new Date(Date.now() - o.since * 1000));
          if (o.json) console.log(JSON.stringify(report));
          else {
            console.log(`${report.charges} charges and ${report.refunds} refunds since ${report.since}, ${report.operations} operations: ${report.drift.length} drift`);
            for (const d of report.drift) console.log(`  ${d.kind} ${d.operationId ?? '-'} ${d.chargeIds.join(',')} ${d.detail}`);
          }
          if (report.drift.length > 0) process.exitCode = EXIT.drift;
          return;
        }
        const report = await reconcileNow(pool, gateway, { actor: o.actor, owner: `cli:${process.pid}`, leaseTtlMs: config.worker.leaseTtlMs, log: log!, processingReviewDays: config.processingReviewDays });
        console.log(o.json ? JSON.stringify(report) : `${report.examined} examined: ${report.settled} settled, ${report.needsReview} need review, ${report.skipped} skipped`);
      }),
    );
  });

program
  .command('audit')
  .description('the audit trail of admin actions (resolve, requeue, reconcile), newest last')
  .argument('[op-id]', "only this operation's: its id, or its short id (a unique prefix of 8 or more hex digits)", operationRef)
  .addOption(new Option('--limit <n>', 'the newest n entries').argParser(positiveInt).default(100))
  .option('--json', 'machine-readable output')
  .action(async (id: string | undefined, o) => {
    await withDatabase(async ({ pool }) => {
      const operationId = id === undefined ? undefined : (await findOperation(pool, id)).id;
      printAudit(await listAudit(pool, { operationId, limit: o.limit }), o.json);
    });
  });

program
  .command('settlements')
  .description('settlement events for the application (onSettled)')
  .command('redrive')
  .description('send dead-lettered settlement events to onSettled again, once the failing handler is fixed')
  .option('--json', 'machine-readable output')
  .action(async (o) => {
    await withDatabase(({ url, pool }) =>
      withBoss(url, async (boss) => {
        const redriven = await redriveSettlements(pool, boss);
        console.log(o.json ? JSON.stringify({ redriven }) : `${redriven} settlement events sent again`);
      }),
    );
  });

function defaultActor(): string {
  return `cli:${process.env.USER ?? userInfo().username}`;
}

function required(value: string | undefined, message: string): string {
  if (!value) throw new InvalidArgumentError(message);
  return value;
}

function progressPrinter(): ((s: BulkSummary) => void) | undefined {
  if (!process.stderr.isTTY) return undefined;
  let last = 0;
  return (s) => {
    if (Date.now() - last < 200) return;
    last = Date.now();
    process.stderr.write(`\r${s.confirmed + s.alreadyConfirmed} confirmed, ${s.failed} refused, line ${s.lines}`);
  };
}

async function confirmBulk(pool: ReturnType<typeof openPool>, file: string, json: boolean): Promise<void> {
  // Only --json prints each line's operation: text output keeps none of them, however long the file.
  const s = await confirmFromFile(pool, file, { onProgress: progressPrinter(), keepConfirmations: json });
  if (process.stderr.isTTY) process.stderr.write('\n');
  if (json) console.log(JSON.stringify(s));
  else {
    console.log(`${s.lines} lines: ${s.confirmed} confirmed, ${s.alreadyConfirmed} already confirmed, ${s.failed} refused`);
    for (const f of s.failures) console.error(`line ${f.line}: ${f.error}`);
  }
  if (s.unconfirmed.length > 0) {
    const unread = s.unreadFromLine ? `, nor lines ${s.unreadFromLine} and after (not read)` : '';
    console.error(
      `outboxd: stopped on a database error (${s.unconfirmed[0]!.error}): lines ${ranges(s.unconfirmed.map((u) => u.line))} not confirmed${unread}; ` +
        'run the same file again (confirmed orders keep their operation)',
    );
    process.exitCode = EXIT.failure;
  } else if (s.failed > 0) process.exitCode = EXIT.partial;
}

try {
  await program.parseAsync();
} catch (err) {
  const message = err instanceof CommanderError && commanderPrinted ? undefined : errorMessage(err, errorContext);
  if (message !== undefined) {
    process.stderr.write(`outboxd: ${message}\n`);
    log?.debug({ err }, "command failed");
  }
  process.exitCode = exitCodeOf(err);
} finally {
  // A collector that does not answer must not hold the exit (its request would, until it times out).
  const flushed = !tracing || (await tracing.shutdown());
  // Nor may a call still running past the worker's grace (its lease kept, left to lapse) hold it for as
  // long as Stripe takes to answer, nor a request whose answer the Stripe client gave up on.
  if (!flushed || workerStopped) process.exit();
}
