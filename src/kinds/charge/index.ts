// The charge: a PaymentIntent for an order (policy idempotent-key). Its request and input
// (request.ts, input.ts), its calls (calls.ts), and how a PaymentIntent matches and settles it
// (evidence.ts), registered as any kind is.
import type { Kind } from '../../types/kind.ts';
import type { PaymentGateway } from '../../stripe/gateway.ts';
import { chargeCalls } from './calls.ts';
import { CHARGE, chargeEvidence } from './evidence.ts';

export function chargeKind(gateway: PaymentGateway): Kind {
  return { kind: CHARGE, policy: 'idempotent-key', calls: chargeCalls(gateway), evidence: chargeEvidence(gateway) };
}
