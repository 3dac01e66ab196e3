// Every kind outboxd carries out, registered the same way: the built-in Stripe kinds, bound to a gateway,
// and the application's own (outboxd.defineEffect, `outboxd worker --effects`). Adding a Stripe kind is a
// folder beside charge/, refund/, capture/ and cancel/ and a line in BUILT_IN below; nothing that reads kinds (the engine,
// the webhooks, resolve, drift, the console) names one.
import { Kinds } from '../engine/kinds.ts';
import type { KindEvidence, KindNaming } from '../types/kind.ts';
import type { PaymentGateway } from '../stripe/gateway.ts';
import type { Queryable } from '../db/pool.ts';
import { RECONCILE_QUEUE } from '../outbox/outbox.ts';
import { PRUNE_QUEUE } from '../outbox/retention.ts';
import { SETTLED_QUEUE } from '../outbox/settlements.ts';
import { applicationKind, type EffectDefinitions } from './application/definition.ts';
import { chargeKind } from './charge/index.ts';
import { CHARGE, CHARGE_NAMING } from './charge/evidence.ts';
import { refundKind } from './refund/index.ts';
import { REFUND, REFUND_NAMING } from './refund/evidence.ts';
import { CAPTURE, CAPTURE_NAMING, captureKind } from './capture/index.ts';
import { CANCEL, CANCEL_NAMING, cancelKind } from './cancel/index.ts';
import { BUILT_IN_KINDS } from './names.ts';

export { BUILT_IN_KINDS };

const BUILT_IN = [
  { kind: CHARGE, naming: CHARGE_NAMING, bind: chargeKind },
  { kind: REFUND, naming: REFUND_NAMING, bind: refundKind },
  { kind: CAPTURE, naming: CAPTURE_NAMING, bind: captureKind },
  { kind: CANCEL, naming: CANCEL_NAMING, bind: cancelKind },
];

/** Names an application's kind may not take: outboxd's own kinds and queues (a kind's name is its queue's;
 * pg-boss creates none twice, so a kind named as one would run on that queue's policy, and its worker and
 * outboxd's take each other's jobs). Dead letters' names are refused by their suffix. */
export const RESERVED_KINDS: ReadonlySet<string> = new Set([...BUILT_IN_KINDS, SETTLED_QUEUE, RECONCILE_QUEUE, PRUNE_QUEUE]);

/** The registry a process's engine receives: the built-in kinds on `gateway`, and the application's. */
export function kindsFor(gateway: PaymentGateway, defined?: EffectDefinitions): Kinds {
  const kinds = new Kinds(BUILT_IN.map((k) => k.bind(gateway)));
  for (const [kind, def] of defined ?? []) kinds.add(applicationKind(kind, def));
  return kinds;
}

/** The evidence of every kind a provider can show, on `gateway` (the webhooks, the drift report). */
export function evidenceOf(gateway: PaymentGateway): { kind: string; evidence: KindEvidence<Queryable> }[] {
  return BUILT_IN.map((k) => ({ kind: k.kind, evidence: k.bind(gateway).evidence! }));
}

/** How a kind is named to people, without a gateway (the console); undefined for an application's kind. */
export function namingOf(kind: string): KindNaming | undefined {
  return BUILT_IN.find((k) => k.kind === kind)?.naming;
}
